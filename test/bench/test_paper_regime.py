"""bench/paper_regime.py: how the processes share the work, the budgets in the paper's
proportions, retention by stream minute, and a smoke run of two processes and their merge."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import paper_regime
from bench.common import finished_streams


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"lengths": ["1800:2", "3600:1"], "first_seed": 0,
                                 "policies": list(paper_regime.POLICIES), "part": "1/1",
                                 "window_share": 8.0} | given)


def test_two_processes_share_every_policy_of_every_stream_once():
    """Each policy of a stream runs in exactly one process; `full` alternates between them."""
    args = _args()
    assert paper_regime.streams(args) == [(1800, 0), (1800, 1), (3600, 0)]
    for index in range(3):
        one = paper_regime.my_policies(_args(part="1/2"), index)
        two = paper_regime.my_policies(_args(part="2/2"), index)
        assert sorted(one + two) == sorted(args.policies) and not set(one) & set(two)
        assert (paper_regime.FULL in one) == (index % 2 == 0)
    assert paper_regime.my_policies(args, 1) == args.policies


def test_a_budget_keeps_the_papers_proportions():
    """M is the fraction of the stream's tokens, the window M / 8; the sinks always fit."""
    assert paper_regime.budget_of(_args(), 0.02, 50_400, 3) == (1008, 126)
    assert paper_regime.budget_of(_args(), 0.001, 100, 3) == (4, 0)


def test_retention_is_counted_per_stream_minute():
    chunks = [([], [t, t + 0.5]) for t in (0.0, 59.0, 60.0, 150.0)]
    counts = [10, 12, 14, 16]
    assert paper_regime.minute_tokens(chunks, counts, 180) == [22, 14, 16]
    held = {1: 5, 3: 16}
    assert paper_regime.minute_tokens(chunks, counts, 180, held) == [5, 0, 16]
    records = [{"condition": "surprise@0.02", "seconds": 180, "minute_tokens": [22, 14, 16],
                "held_tokens": [5, 0, 16]}] * 2
    table = paper_regime.retention(records)
    assert table == {"surprise@0.02": {"180": [[10, 0, 32], [44, 28, 32]]}}
    assert paper_regime.thirds(table["surprise@0.02"]["180"]) == "22.7 · 0.0 · 100.0"


def test_a_resumed_run_keeps_whole_streams_and_drops_the_one_cut_off(tmp_path):
    path = tmp_path / "paper_regime.jsonl"
    whole = [{"seconds": 1800, "seed": 0, "condition": "full", "question": "q"},
             {"seconds": 1800, "seed": 0, "stream_done": True}]
    cut = [{"seconds": 1800, "seed": 1, "condition": "full", "question": "q"}]
    text = "".join(json.dumps(r) + "\n" for r in whole + cut) + '{"seconds": 18'
    path.write_text(text)
    assert finished_streams(path, keep_only_them=False) == {(1800, 0)}
    assert path.read_text() == text  # only read
    assert finished_streams(path, keep_only_them=True) == {(1800, 0)}
    assert [json.loads(line) for line in path.read_text().splitlines()] == whole
    path.write_text('{"seconds": 18\n' + text)
    with pytest.raises(SystemExit, match="line 1 is not JSON"):
        finished_streams(path, keep_only_them=True)


@pytest.mark.slow  # streams through the shipped model
def test_two_parts_and_their_merge_report_every_cell(tmp_path):
    common = ["--lengths", "20:1", "--objects", "2", "--fractions", "0.05", "0.1",
              "--policies", "full", "surprise", "recency"]
    for part in ("1/2", "2/2"):
        paper_regime.main([*common, "--part", part, "--out", str(tmp_path / part[0])])
    files = [str(tmp_path / p / "paper_regime.jsonl") for p in "12"]
    answers = (tmp_path / "1" / "paper_regime.jsonl").read_text()
    with pytest.raises(SystemExit, match="--resume"):  # never the same stream twice
        paper_regime.main([*common, "--part", "1/2", "--out", str(tmp_path / "1")])
    paper_regime.main([*common, "--part", "1/2", "--out", str(tmp_path / "1"), "--resume"])
    assert (tmp_path / "1" / "paper_regime.jsonl").read_text() == answers  # nothing left to do
    paper_regime.main(["--report", *files, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "paper_regime.json").read_text())
    assert set(results["table"]) == {"full", "surprise@0.05", "surprise@0.1", "recency@0.05",
                                     "recency@0.1"}
    assert set(results["retention"]) == set(results["table"])
    held, brought = results["retention"]["full"]["20"]
    assert held == brought  # full memory keeps every token
    report = (tmp_path / "paper_regime.md").read_text()
    assert "| stream | budget | M (tokens) | window | tokens a chunk | chunks M holds |" in report
    assert "| condition | early | middle | late | never shown |" in report
    assert "| stream | budget | recency - surprise |" in report
    assert "![retention by stream time](paper_regime.png)" in report
    assert (tmp_path / "paper_regime.png").stat().st_size > 10_000


def test_a_run_of_full_memory_alone_draws_no_plot(tmp_path):
    table = {"full": {"60": [[10], [10]]}}
    assert paper_regime.plot(table, tmp_path) == ""
    assert paper_regime.retention_report(table).count("\n") == 2  # the header alone
