"""bench/recall.py: a smoke run of the second tier's accuracy benchmark, and its reading of the
records."""

from __future__ import annotations

import json

import pytest
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import recall


def _records(hits: dict[str, list[int]]) -> list[dict]:
    """One question a stream (seed) per entry: 1 right, 0 wrong."""
    return [{"seconds": 120, "seed": seed, "condition": condition, "correct": bool(right),
             "position": "early", "latency_ms": 10.0 * (1 + (recall.RECALL in condition)),
             "recalled_chunks": 2, "recall_tokens": 30, "tier_host_bytes": 2**20,
             "tier_lost": 0}
            for condition, answers in hits.items() for seed, right in enumerate(answers)]


def test_full_memory_is_paired_at_every_budget_and_recall_costs_are_read_side_by_side():
    records = _records({"full": [1, 1, 1, 1], "surprise@0.02": [1, 0, 0, 1],
                        "surprise+recall@0.02": [1, 1, 0, 1], "recency@0.02": [0, 0, 0, 0],
                        "recency+recall@0.02": [1, 0, 0, 0]})
    assert recall.policies(records) == ["surprise", "recency"]  # the default first
    assert recall.columns(records) == [(120, 0.02)]
    row = recall.differences(records).splitlines()[-1].split(" | ")
    assert row[2].startswith("-25 ")  # surprise+recall - full
    assert row[4].startswith("+25 ")  # surprise+recall - surprise
    assert row[-1].startswith("+50 ")  # surprise+recall - rekv
    costs = recall.costs(records).splitlines()
    assert costs[2] == "| 120 s | 2 % | surprise+recall | 30 | 2.0 | 10 | 20 | 2.00 | 1.00 | 0 |"
    assert "| recency+recall (rekv) |" in recall.accuracy(records)


@pytest.mark.slow  # streams through the shipped model
def test_recall_bench_runs(tmp_path):
    recall.main(["--streams", "1", "--objects", "3", "--seconds", "24", "--fractions", "0.1",
                 "--out", str(tmp_path)])
    records = [json.loads(r) for r in (tmp_path / "recall.jsonl").read_text().splitlines()]
    conditions = {r["condition"] for r in records}
    assert conditions == {"full", "surprise@0.1", "surprise+recall@0.1", "recency@0.1",
                          "recency+recall@0.1"}
    with_recall = [r for r in records if r["condition"].endswith("+recall@0.1")]
    assert all(r["tier_host_bytes"] > 0 and r["tier_lost"] == 0 for r in with_recall)
    assert all(r["recalled_chunks"] >= 0 and r["latency_ms"] > 0 for r in records)
    assert not any(r["recalled_chunks"] for r in records if "+recall" not in r["condition"])
    report = (tmp_path / "recall.md").read_text()
    assert "| full |" in report and "| surprise+recall - full |" in report
    assert "time with / without (sums)" in report
