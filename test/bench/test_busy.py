"""bench/busy.py, bench/busy_retention.py and bench/busy_misses.py: the questions they ask about a
busy stream, where an object sits in it and what it shares, and a smoke run of each."""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import busy, busy_misses, busy_retention
from deltas_ros.training.questions import identities_of
from deltas_ros.training.samples import TRAIN_SEEDS, VALIDATION_SEEDS


def test_questions_cover_every_object_and_unseen_pairs():
    """Every object is asked about (yes), as many pairs never shown (no, none asked twice);
    colour and shape questions are split by whether one object or several have the shape or
    colour."""
    def obj(time, colour, shape):
        return {"kind": "object", "time": time, "end": time + 2, "shape": shape,
                "colour": colour}

    events = [obj(1, "red", "circle"), obj(9, "blue", "circle"), obj(20, "red", "square"),
              obj(30, "red", "circle")]
    asked = busy.busy_questions(events, 0)
    kinds = [k for k, _ in asked]
    assert kinds.count("seen: shown") == kinds.count("seen: never shown") == 3
    assert all(qa.answer.endswith("yes") for k, qa in asked if k == "seen: shown")
    negatives = [qa.question for k, qa in asked if k == "seen: never shown"]
    assert all(qa.answer.endswith("no") for k, qa in asked if k == "seen: never shown")
    assert len(set(negatives)) == len(negatives)
    by_question = {qa.question: (k, qa.answer) for k, qa in asked}
    assert by_question["What color was the circle?"] == \
        ("colour: shared", "the circle was red and blue")
    assert by_question["What color was the square?"] == ("colour: unique", "the square was red")
    assert by_question["Which shape was red?"] == \
        ("shape: shared", "a red circle and a red square")
    assert by_question["Which shape was blue?"] == ("shape: unique", "a blue circle")
    assert busy.busy_questions(events, 0) == asked  # deterministic by seed
    assert len(identities_of(events)) == 3


@pytest.mark.slow  # streams through the shipped model
def test_busy_bench_runs(tmp_path):
    earlier = {"setting": "9:9", "seed": 0, "kind": "seen: shown", "correct": True}
    (tmp_path / "busy.jsonl").write_text(json.dumps(earlier) + "\n")  # another run's answers
    busy.main(["--streams", "1", "--settings", "2:6", "--out", str(tmp_path)])
    table = json.loads((tmp_path / "busy.json").read_text())["table"]
    assert set(table) == {"2:6"} and "seen: shown" in table["2:6"]
    records = (tmp_path / "busy.jsonl").read_text().splitlines()
    assert all({"kind", "answer", "correct"} <= set(json.loads(r)) for r in records)
    assert "| seen: never shown |" in (tmp_path / "busy.md").read_text()


def test_validation_streams_stay_apart_from_held_out_and_training_ones():
    """--validation draws seeds no evaluation and no training draws; ranges that leave their
    side are refused."""
    held_out = busy.stream_seeds(Namespace(first_seed=3, streams=2))
    validation = busy.stream_seeds(Namespace(first_seed=3, streams=2, validation=True))
    assert list(held_out) == [3, 4]
    assert VALIDATION_SEEDS <= busy.BUSY_VALIDATION + 3 == validation[0] < TRAIN_SEEDS
    with pytest.raises(ValueError, match="evaluation range"):
        busy.stream_seeds(Namespace(first_seed=VALIDATION_SEEDS - 1, streams=2))
    with pytest.raises(ValueError, match="validation range"):
        busy.stream_seeds(Namespace(first_seed=TRAIN_SEEDS, streams=1, validation=True))


def test_an_object_is_placed_where_it_was_last_in_view():
    events = [{"kind": "object", "time": t, "end": t + 2, "shape": "circle", "colour": c}
              for t, c in ((5, "red"), (50, "blue"), (95, "red"))]
    where = busy_retention.position
    assert where(events, "Did you see a red circle?", 120) == "late"  # back in view at 95 s
    assert where(events, "Did you see a blue circle?", 120) == "middle"
    assert where(events, "Did you see a green circle?", 120) == busy_retention.NEVER


def _records(hits: dict[str, list[int]], seconds: int = 120) -> list[dict]:
    """One question a stream (seed) per entry: 1 right, 0 wrong."""
    return [{"seconds": seconds, "seed": seed, "condition": condition, "correct": bool(right),
             "position": "early"}
            for condition, answers in hits.items() for seed, right in enumerate(answers)]


def test_verdicts_read_the_intervals_as_the_targets_do():
    """The best share names every policy at it; a state-based policy counts as level only
    inside the best's interval; DeltaS is ahead only when its lower bound clears every
    control's upper bound."""
    many = 60
    table = busy_retention.aggregate(_records({
        "key_norm@0.02": [1] * many, "surprise@0.02": [1] * (many - 1) + [0],
        "deltas@0.02": [1] * (many // 2) + [0] * (many // 2),
        "recency@0.02": [0] * many, "uniform@0.02": [0] * many, "random@0.02": [0] * many}))
    row = busy_retention.verdicts(table).splitlines()[-1]
    assert row == "| 120 s | 2 % | 100: key_norm | surprise | yes |"
    folded = busy_retention.summary(table).splitlines()
    assert folded[2:4] == ["| key_norm | 100 |", "| surprise | 98 |"]  # best first
    table = busy_retention.aggregate(_records({
        "deltas@0.02": [1, 0, 1, 1], "recency@0.02": [0, 0, 1, 0],
        "uniform@0.02": [1, 0, 1, 0], "random@0.02": [1, 1, 1, 1]}))
    row = busy_retention.verdicts(table).splitlines()[-1]
    assert row == "| 120 s | 2 % | 100: random | deltas | no |"  # 4 questions: wide


def test_paired_difference_is_per_question_with_a_stream_bootstrap():
    records = _records({"surprise@0.05": [1, 1, 1, 1], "deltas@0.05": [1, 0, 1, 0]})
    diff, low, high = busy_retention.paired(records, "surprise", "deltas", 120, 0.05)
    assert diff == 50 and 0 <= low <= diff <= high <= 100
    assert busy_retention.paired(records, "surprise", "deltas", 120, 0.05) == \
        (diff, low, high)  # deterministic
    assert busy_retention.paired(records, "surprise", "deltas", 300, 0.05) is None


@pytest.mark.slow  # streams through the shipped model
def test_busy_retention_bench_runs(tmp_path):
    busy_retention.main(["--streams", "1", "--objects", "3", "--seconds", "12",
                         "--fractions", "0.3", "--policies", "deltas", "recency",
                         "--out", str(tmp_path)])
    table = json.loads((tmp_path / "busy_retention.json").read_text())["table"]
    assert set(table) == {"full", "state", "deltas@0.3", "recency@0.3"}
    assert all(set(per) == {"12"} and "all" in per["12"] for per in table.values())
    report = (tmp_path / "busy_retention.md").read_text()
    assert "| condition | early | middle | late | never shown |" in report
    assert "| stream | budget | best | state-based within the best's interval |" in report
    assert "![retention per policy](busy_retention.png)" in report
    assert (tmp_path / "busy_retention.png").stat().st_size > 10_000


def test_an_object_is_grouped_by_what_it_shares_with_earlier_objects():
    events = [{"kind": "object", "time": t, "end": t + 2, "shape": s, "colour": c}
              for t, c, s in ((5, "red", "circle"), (20, "blue", "square"),
                              (40, "blue", "triangle"), (60, "red", "circle"))]
    assert busy_misses.sharing(events, "red", "circle") == "again"  # back at 60 s
    assert busy_misses.sharing(events, "blue", "square") == "new"
    assert busy_misses.sharing(events, "blue", "triangle") == "shares"  # blue at 20 s
    chunk_times = np.array([4.25, 5.25, 7.25, 30.25, 62.25])  # 2 frames 0.5 s apart each
    assert busy_misses.in_view(events, "red", "circle", chunk_times).tolist() == \
        [False, True, True, False, True]


@pytest.mark.slow  # streams through the shipped model
def test_busy_misses_bench_runs(tmp_path):
    busy_misses.main(["--streams", "1", "--objects", "3", "--seconds", "12", "--fraction", "0.3",
                      "--policies", "surprise", "--out", str(tmp_path)])
    records = [json.loads(r) for r in (tmp_path / "busy_misses.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["group"] in busy_misses.GROUPS for r in records)
    assert all(r["held"] >= 0 and 0 <= r["percentile"] <= 1 for r in records)
    assert "| surprise | 12 s | all | 3 |" in (tmp_path / "busy_misses.md").read_text()
