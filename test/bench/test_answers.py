"""Smoke test of bench/answers.py (answers per retention policy) and its interval."""

from __future__ import annotations

import json

import pytest
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import answers


def test_wilson_interval():
    assert answers.wilson(0, 0) == (0.0, 1.0)
    lo, hi = answers.wilson(9, 10)
    assert lo == pytest.approx(0.596, abs=1e-3) and hi == pytest.approx(0.982, abs=1e-3)
    lo, hi = answers.wilson(10, 10)
    assert hi == 1.0 and 0.69 < lo < 0.73


@pytest.mark.slow  # streams through the shipped model (no model fixture marks it)
def test_answers_bench_runs_every_condition(tmp_path):
    answers.main(["--streams", "1", "--seconds", "6", "--lengths", "1", "--policies", "deltas",
                  "recency", "pixel_diff", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "answers.json").read_text())
    table = results["table"]
    assert set(table) == {"full", "state", "deltas@0.1", "recency@0.1", "pixel_diff@0.1",
                          "deltas@0.25", "recency@0.25", "pixel_diff@0.25"}
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    per_condition = {r["condition"] for r in records}
    assert per_condition == set(table)
    questions = [r["question"] for r in records if r["condition"] == "full"]
    assert questions == [r["question"] for r in records if r["condition"] == "state"]
    assert (tmp_path / "answers.png").stat().st_size > 0
    assert "| full |" in (tmp_path / "answers.md").read_text()
    about_one = [r for r in records if r["shown"]]
    assert about_one and all(len(r["shown"]) == 2 and r["evidence"] for r in about_one)
    assert all("evidence" in cell for cell in table["full"].values())
    assert all("evidence:colour" in cell for cell in table["full"].values())
    assert "per question form, %" in (tmp_path / "answers.md").read_text()


def test_evidence_at_the_event_is_the_strongest_chunk_within_the_span():
    record = {"shown": [4.2, 7.0], "evidence": [5.25, 12.25]}
    assert answers.evidence_at_event(record)
    assert not answers.evidence_at_event(record | {"evidence": [12.25, 5.25]})  # not the strongest
    assert answers.evidence_at_event(record | {"evidence": [3.25]})  # within the slack
    assert not answers.evidence_at_event(record | {"evidence": []})
