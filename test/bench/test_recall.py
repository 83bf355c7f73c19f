"""bench/recall.py: a smoke run of the second tier's accuracy benchmark, and its reading of the
records."""

from __future__ import annotations

import json

import pytest
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import busy_retention, recall


def _records(hits: dict[str, list[int]]) -> list[dict]:
    """One question about a shown object a stream (seed) per entry: 1 right, 0 wrong; recall
    rows recall 2 chunks, the oracle's both with the object."""
    return [{"seconds": 120, "seed": seed, "condition": condition, "correct": bool(right),
             "position": "early", "latency_ms": 10.0 * (1 + (recall.RECALL in condition)),
             "recalled_chunks": 2, "recall_tokens": 30, "tier_host_bytes": 2**20,
             "tier_lost": 0, "recalled_with_object": 2 if "oracle" in condition else seed % 2,
             "object_chunks_held": seed % 2, "object_chunks_tiered": 1}
            for condition, answers in hits.items() for seed, right in enumerate(answers)]


def test_full_memory_is_paired_at_every_budget_and_recall_costs_are_read_side_by_side():
    records = _records({"full": [1, 1, 1, 1], "surprise@0.02": [1, 0, 0, 1],
                        "surprise+recall:mean@0.02": [1, 1, 0, 1],
                        "surprise+recall:oracle@0.02": [1, 1, 1, 1],
                        "recency@0.02": [0, 0, 0, 0],
                        "recency+recall:mean@0.02": [1, 0, 0, 0]})
    assert recall.policies(records) == ["surprise", "recency"]  # the default first
    assert recall.kinds(records) == ["mean", "oracle"]
    assert recall.columns(records) == [(120, 0.02)]
    row = recall.differences(records).splitlines()[2].split(" | ")
    assert row[2] == "surprise+recall:mean"
    assert row[3].startswith("-25 ")  # - full
    assert row[4].startswith("+25 ")  # - surprise
    assert row[5].startswith("+50 ")  # - rekv
    costs = recall.costs(records).splitlines()
    assert costs[2] == ("| 120 s | 2 % | surprise+recall:mean | 30 | 2.0 | 10 | 20 | 2.00 | 1.00 "
                        "| 0 |")
    assert "| recency+recall:mean (rekv) |" in recall.accuracy(records)
    aim = recall.aim(records).splitlines()
    assert aim[2] == "| 120 s | 2 % | surprise+recall:mean | 4 | 0.25 | 0.50 | 2 | 1 | 2 |"
    assert aim[3].startswith("| 120 s | 2 % | surprise+recall:oracle | 4 | 1.00 | 1.00 |")


@pytest.mark.slow  # streams through the shipped model
def test_recall_bench_runs(tmp_path, monkeypatch):
    options = ["--streams", "1", "--objects", "3", "--seconds", "24", "--fractions", "0.1",
               "--policies", "recency", "--summary", "mean", "top-norm", "--queries", "first",
               "every-layer", "--out", str(tmp_path)]
    recall.main(options)
    answers = (tmp_path / "recall.jsonl").read_text()
    *records, done = [json.loads(r) for r in answers.splitlines()]
    assert done == {"seconds": 24, "seed": 0, "stream_done": True}
    monkeypatch.setattr(busy_retention, "held_out_scene", None)  # rendering would fail
    recall.main([*options, "--resume"])  # the stream is whole: nothing to do, nothing drawn
    assert (tmp_path / "recall.jsonl").read_text() == answers
    conditions = {r["condition"] for r in records}
    assert conditions == {"full", "recency@0.1", "recency+recall:mean@0.1",
                          "recency+recall:top-norm@0.1", "recency+recall:oracle@0.1",
                          "recency+recall:mean/every-layer@0.1",
                          "recency+recall:top-norm/every-layer@0.1"}
    assert recall.kinds(records) == ["mean", "mean/every-layer", "top-norm",
                                     "top-norm/every-layer", "oracle"]
    with_recall = [r for r in records if "+recall" in r["condition"]]
    assert all(r["tier_host_bytes"] > 0 and r["tier_lost"] == 0 for r in with_recall)
    assert all(r["recalled_chunks"] >= 0 and r["latency_ms"] > 0 for r in records)
    assert not any(r["recalled_chunks"] for r in records if "+recall" not in r["condition"])
    oracle = [r for r in records if "oracle" in r["condition"]]
    assert all(r["recalled_with_object"] == r["recalled_chunks"] for r in oracle)
    assert any(r["recalled_chunks"] for r in oracle)
    report = (tmp_path / "recall.md").read_text()
    assert "| full |" in report and "| recency+recall:mean (rekv) |" in report
    assert "time with / without (sums)" in report and "of them tiered" in report
