"""bench/hour_node.py: the question it asks about a stretch of the stream, and its smoke run (two
minutes of busy stream through the real node at 8x: seconds). No timing target is asserted; the
hour's figures come from the benchmark itself."""

from __future__ import annotations

import json

import pytest
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import hour_node
from deltas_ros.training.scenes import BUSY, SceneStream

pytestmark = pytest.mark.slow



def test_the_question_is_about_the_newest_object_shown_in_the_stretch_else_before_it():
    scene = SceneStream(600, 128, 96, 3, BUSY)
    objects = [e for e in scene.events() if e["kind"] == "object"]
    last = objects[-1]
    asked = hour_node.question_about(scene, last["end"] - 1, last["end"] + 1)
    assert asked["question"] == f"Did you see a {last['colour']} {last['shape']}?"
    assert asked["in_stretch"] and asked["truth"].endswith(": yes")
    # A stretch with nothing shown in it: the newest object shown before it.
    later = hour_node.question_about(scene, last["end"] + 1, last["end"] + 30)
    assert not later["in_stretch"] and later["question"] == asked["question"]
    assert later["shown_ago_s"] == pytest.approx(30, abs=0.1)


def test_smoke_run_accounts_every_chunk_and_answers_every_question(tmp_path, ros_env):
    hour_node.main(["--smoke", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "hour_node.json").read_text())
    assert "--smoke" in results["command"] and results["machine"]["load_avg_1m_end"] >= 0
    run = results["run"]
    accounted = run["chunks_processed"] + run["chunks_dropped"] + run["chunks_discarded"]
    assert accounted in (run["chunks_expected"] - 1, run["chunks_expected"])
    # Every chunk index missing from ~/drift is a chunk the node counted as dropped (a loaded
    # machine cannot keep up with 8x): nothing is lost uncounted.
    assert run["chunks_failed"] == 0
    assert run["index_gaps"] <= run["chunks_dropped"] + run["chunks_discarded"]
    assert 0 < run["max_kv_tokens"] <= run["config"]["budget_tokens"]
    assert run["config"]["window_tokens"] == run["config"]["budget_tokens"] // 8
    assert run["budget_reached"]["chunk"] < run["chunks_processed"]
    assert len(run["questions"]) == 4 and all(q["success"] for q in run["questions"])
    assert run["rss_mib"]["growth_end"] is not None and run["chunk_ms"]["median"] > 0
    assert (tmp_path / "hour_node.png").stat().st_size > 0
    assert "| every question answered |" in (tmp_path / "hour_node.md").read_text()
