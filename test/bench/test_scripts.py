"""Smoke tests of the benchmark scripts (bench/): tiny settings, sane results, no timing targets.

They keep the scripts from rotting as the engine and the node change: each one runs end to end
in a few seconds and the JSON it writes has the expected keys and plausible values.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_helpers import one_thread  # noqa: F401 (autouse)

from bench import (
    bounded_memory,
    end_to_end,
    engine_overhead,
    ingest,
    memory_view,
    node_path,
    real_size,
    retention,
    train_step,
)
from bench.common import bench_model, verdict
from deltas_ros.core.model_maker import config_from_file
from deltas_ros.core.policy import POLICY_NAMES

# Each script builds and runs a model: seconds each.
pytestmark = pytest.mark.slow

TINY_STREAM = ["--pixel-budget", "4096", "--width", "160", "--height", "120"]



def written(out: Path, name: str) -> dict[str, Any]:
    assert (out / f"{name}.md").read_text().startswith("### ")
    results = json.loads((out / f"{name}.json").read_text())
    assert results["command"].split(" -m ")[1].startswith(f"bench.{name}")
    assert results["machine"]["cores"] >= 1 and results["wall_s"] >= 0
    return results


def test_the_in_memory_random_model_equals_make_model_and_load_model(tiny_model):
    args = argparse.Namespace(model=None, config=None, device="cpu", dtype="auto", seed=0)
    built = bench_model(args)
    expected = tiny_model.model.state_dict()
    assert all(torch.equal(tensor, expected[name])
               for name, tensor in built.model.state_dict().items())
    text = "<|im_start|>user\n<0.2 seconds><|vision_start|>"
    assert built.tokenizer.encode(text) == tiny_model.tokenizer.encode(text)
    assert built.dtype == torch.float32 and built.fla_kernels is False


def test_engine_overhead(tmp_path):
    engine_overhead.main(["--chunks", "12", "--warmup", "1", "--budget", "120", "--window", "40",
                          *TINY_STREAM, "--micro-budget", "2048", "--micro-reps", "1",
                          "--out", str(tmp_path)])
    results = written(tmp_path, "engine_overhead")
    assert set(results["policies"]) == set(POLICY_NAMES)
    for row in results["policies"].values():
        assert row["forward_ms"] > 0 and row["eviction_events"] > 0
        assert row["evict_ms_per_event"] > 0 and row["max_kv_tokens"] <= 120
    deltas, strength = results["policies"]["deltas"], results["policies"]["write_strength"]
    assert deltas["policy_signal_ms"] >= deltas["engine_drift_ms"] > 0
    assert strength["policy_signal_ms"] > deltas["policy_signal_ms"]  # the token-level replay
    assert deltas["signal_x_deltas"] == deltas["evict_x_deltas"] == 1.0
    policies = results["policies"]
    assert policies["beta_error"]["policy_signal_ms"] > policies["surprise"]["policy_signal_ms"]
    assert (policies["deltas_surprise"]["policy_signal_ms"]
            >= policies["deltas_surprise"]["engine_drift_ms"])
    micro = results["micro"]
    assert micro["budget"] == 2048 and micro["state_mib"] == 48
    assert micro["signal_ms"] > 0 and micro["evict_ms"] >= micro["select_ms"] > 0
    assert micro["beta_error_ms"] > micro["surprise_ms"] > 0 and micro["infinipot_v_ms"] > 0
    # Each verdict follows from its own figures; on a CPU the H200 targets are never judged.
    verdicts = {c["check"]: c["result"] for c in results["checks"]}
    targets = engine_overhead.TARGETS
    assert verdicts["DeltaS signal / forward"] == verdict(
        deltas["signal_fraction"] <= targets["signal_fraction"])
    assert verdicts["eviction per event / forward (deltas run)"] == verdict(
        deltas["evict_fraction"] <= targets["evict_fraction"])
    assert micro["evict_fill_ms"] >= micro["fill_ms"] > 0
    assert verdicts["eviction at 9B sizes, gather / the engine's (fill; same run)"] == verdict(
        micro["evict_ms"] >= targets["fill_speedup"] * micro["evict_fill_ms"])
    on_gpu = [c for c in results["checks"] if "H200" in c["target"]]
    assert len(on_gpu) == 4 and all(c["result"] == "n/a (CPU)" for c in on_gpu)


def test_node_path(tmp_path):
    node_path.main(["--chunks", "12", "--budget", "120", "--window", "40", "--ask-every", "5",
                    "--max-new-tokens", "2", "--sample-every", "4", *TINY_STREAM,
                    "--out", str(tmp_path)])
    results = written(tmp_path, "node_path")
    assert results["eviction_events"] > 0 and results["max_kv_tokens"] <= 120
    assert [q["chunk"] for q in results["questions"]] == [4, 9]
    assert results["signal_ms"] > 0 and results["evict_ms_per_event"] > 0
    assert results["flatness_of"] == "rss_bytes" and [s["chunk"] for s in results["samples"]] \
        == [3, 7, 11]


def test_memory_view(tmp_path):
    memory_view.main(["--held", "5", "80", "--rounds", "3", "--out", str(tmp_path)])
    rows = written(tmp_path, "memory_view")["rows"]
    assert [r["held"] for r in rows] == [5, 80]
    assert all(r["image_ms"] > 0 and r["chunks_ms"] > 0 and r["markers_ms"] > 0 for r in rows)
    # DELETEALL, arrows (at most 64), labels (at most 12), the path, 3 evidence arrows + labels
    assert [r["marker_count"] for r in rows] == [1 + 5 + 5 + 1 + 6, 1 + 64 + 12 + 1 + 6]


def test_train_step_runs_the_three_ways_to_the_same_loss(tmp_path):
    train_step.main(["--seconds", "4", "--rounds", "2", "--out", str(tmp_path)])
    (row,) = written(tmp_path, "train_step")["rows"]
    assert [len(t) for t in row["times_s"].values()] == [2, 2, 2]
    for way in ("kernel", "training"):
        assert row[f"{way}_ratio"] > 0 and row[f"{way}_loss_difference"] < 1e-5
        assert row[f"{way}_largest_gradient_difference"] < 1e-4


def test_real_size_smoke_runs_both_dtypes_on_the_cpu(tmp_path):
    real_size.main(["--smoke", "--out", str(tmp_path)])
    results = written(tmp_path, "real_size")
    assert set(results["dtypes"]) == {"float32", "bfloat16"} and results["budget"] == 120
    for dtype, row in results["dtypes"].items():
        assert row["model"]["dtype"] == dtype and row["model"]["source"] == "tiny"
        assert row["eviction_events"] > 0 and row["max_kv_tokens"] <= 120
        assert row["real_time_factor"] == pytest.approx(row["forward_ms"] / 1000)
        assert row["forward_ms"] > 0
        assert row["signal_fraction"] > 0 and row["evict_fraction"] > 0
        assert row["first_eviction"]["rss_bytes"] > 0 and "rss_growth" in row
        assert [s["chunk"] for s in row["samples"]] == [3, 7, 11]
        (only,) = row["rounds"]
        assert only["candidates"] == 4 and only["same_evidence"] and only["batches"] == 1
        assert only["old_search_ms"] > 0 and only["new_search_ms"] > 0 and only["ask_ms"] > 0
        assert (only["ask_candidates"], only["ask_full_candidates"]) == (2, 4)
        assert only["ask_evidence_full_ms"] > 0 and only["estimate_search_ms"] > 0
        assert only["estimate_bytes_estimate"] > 0
        assert only["ask_evidence_old_ms"] == only["ask_ms"] + only["old_search_ms"]
        # Every signal side by side on the full memory, DeltaS the unit.
        signals = row["signals"]
        assert list(signals) == list(real_size.SIDE_BY_SIDE)
        assert signals["deltas"]["signal_x_deltas"] == 1.0
        assert all(s["policy_signal_ms"] > 0 and s["eviction_events"] == 2
                   for s in signals.values())
    assert results["dtypes"]["float32"]["rounds"][0]["max_drop_difference"] < 1e-4
    verdicts = {c["check"]: c["result"] for c in results["checks"]}
    assert len(verdicts) == 18 and verdicts["float32: evidence, batched vs old"] == "PASS"
    assert verdicts["float32: surprise signal, share of the forward"] == \
        "n/a (not the 0.8B config)"
    assert verdicts["bfloat16: question with evidence (2 candidates)"] == \
        "n/a (not the 0.8B config)"


def test_the_default_real_size_config_has_the_0_8b_dimensions():
    text = config_from_file(real_size.DEFAULT_CONFIG).text_config
    assert (text.num_hidden_layers, text.hidden_size, text.layer_types.count("full_attention"),
            text.linear_num_value_heads, text.num_key_value_heads) == (24, 1024, 6, 16, 2)


def test_gpu_script_smoke_mode_runs_every_step_on_the_cpu(tmp_path):
    """bench/gpu.sh SMOKE=1: the GPU script's own steps and arguments, tiny and on the CPU."""
    env = os.environ | {"SMOKE": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "bench/gpu.sh"], cwd=Path(__file__).resolve().parents[2],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("engine_overhead", "node_path", "bounded_memory"):
        assert written(tmp_path, name)["command"].split(" -m ")[1].startswith(f"bench.{name}")
    assert written(tmp_path, "node_path")["questions"]


def test_bounded_memory(tmp_path):
    bounded_memory.main(["--chunks", "30", "--budget", "120", "--window", "40",
                         "--sample-every", "10", *TINY_STREAM, "--out", str(tmp_path)])
    results = written(tmp_path, "bounded_memory")
    assert 0 < results["max_kv_tokens"] <= 120
    assert [s["chunk"] for s in results["samples"]] == [9, 19, 29]
    assert results["start"]["rss_bytes"] > 0 and results["end"]["rss_bytes"] > 0
    assert results["start"]["memory_bytes"] == results["end"]["memory_bytes"] > 0
    assert 0 < results["next_position"] < results["max_positions"]
    assert results["hours_to_compaction"] > results["default_pixel_budget_hours_to_compaction"] > 0


def test_ingest(tmp_path, ros_env):
    ingest.main(["--seconds", "2", "--width", "320", "--height", "240", "--idle", "0.3",
                 "--inputs", "rgb8/single", "jpeg/node", "rgb8/events/raw",
                 "--out", str(tmp_path)])
    results = written(tmp_path, "ingest")
    assert set(results["inputs"]) == {"rgb8/single", "jpeg/node", "rgb8/events/raw"}
    for name, run in results["inputs"].items():
        assert run["published"] == 60 and run["received"] >= 50, name
        assert run["sampled"] >= 3 and run["chunks"] >= 1
        assert 0 < run["non_sampled_ms"]["median"] < run["sampled_ms"]
        assert run["build_ms"] > 0 and run["process_percent"] > 0
        assert run["page_faults_per_frame"] >= 0
        assert run["copy_ms"] > 0
        if not os.path.exists("/proc/self/schedstat"):  # a kernel without it: no split
            assert run["middleware_ms_per_frame"] is None and run["floor_percent"] is None
            continue
        # Fast DDS's threads receive every frame; they are part of the process, never all of it
        assert 0 < run["middleware_ms_per_frame"] < run["process_ms_per_frame"], name
        assert 0 < run["middleware_percent"] < run["process_percent"], name
        assert run["floor_ms_per_frame"] == pytest.approx(
            run["middleware_ms_per_frame"] + run["callback_ms_per_frame"] + run["copy_ms"])
    assert results["inputs"]["rgb8/single"]["message_bytes"] == 320 * 240 * 3
    assert results["inputs"]["rgb8/single"]["executor_thread_ms_per_frame"] > 0
    assert results["inputs"]["rgb8/events/raw"]["executor_thread_ms_per_frame"] > 0
    assert results["inputs"]["jpeg/node"]["executor_thread_ms_per_frame"] is None


def test_end_to_end(tmp_path, ros_env, tiny_model_dir):
    end_to_end.main(["--model", str(tiny_model_dir), "--seconds", "4", "--width", "320",
                     "--height", "240", "--budget", "120", "--window", "40",
                     "--pixel-budget", "4096", "--out", str(tmp_path)])
    run = written(tmp_path, "end_to_end")["run"]
    assert run["chunks_expected"] == 4 and run["chunks_received"] >= 3
    assert 0 < run["latency_ms"]["median"] <= run["latency_ms"]["max"]
    assert run["processing_ms"]["median"] > 0 and run["real_time_factor"] > 0
    assert 0 < run["kv_tokens_end"] <= 120 and run["node_cpu_cores"] > 0


def test_end_to_end_with_the_dashboard(tmp_path, ros_env, tiny_model_dir):
    end_to_end.main(["--model", str(tiny_model_dir), "--seconds", "3", "--width", "160",
                     "--height", "120", "--budget", "120", "--window", "40",
                     "--pixel-budget", "4096", "--dashboard", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "end_to_end_dashboard.json").read_text())
    command = results["command"]
    assert " -m bench.end_to_end " in command and "--dashboard" in command
    runs = results["runs"]
    alone, attached = runs["alone"], runs["dashboard"]
    assert "dashboard_cpu_cores" not in alone and attached["dashboard_cpu_cores"] >= 0
    for run in (alone, attached):
        assert run["chunks_received"] >= 2 and run["processing_ms"]["median"] > 0
    assert attached["page_events"]["chunk"] >= 1 and attached["page_images_fetched"] >= 1
    assert "| node alone | node + dashboard + one page |" in (
        tmp_path / "end_to_end_dashboard.md").read_text()
    assert not (tmp_path / "end_to_end.json").exists()  # the default run's files stay as they are


def test_retention(tmp_path):
    retention.main(["--seeds", "0", "--seconds", "16", "--event-every", "4",
                    "--fractions", "0.3", "0.6", "--window", "40", *TINY_STREAM,
                    "--out", str(tmp_path)])
    results = written(tmp_path, "retention")
    assert set(results["policies"]) == {*POLICY_NAMES, "pixel_diff"}
    stream = results["streams"][0]
    assert stream["chunks"] == 16 and 0 < stream["event_chunks"] < 16
    for per_fraction in results["policies"].values():
        for row in per_fraction.values():
            assert 0 <= row["event_fraction"] <= 1 and 0 < row["chance"] <= 1
            assert row["event_chunks"] == stream["event_chunks"]


def test_plan_check_runs_a_second_tier_to_its_budget_and_recalls(tmp_path, tiny_model_dir):
    """scripts/plan_check.py (docs/robot.md) on the tiny model: the plan of so small a model is
    mostly the first forward's one-off allocations, so only the run is checked here."""
    out = tmp_path / "plan.json"
    script = Path(__file__).parents[2] / "scripts" / "plan_check.py"
    subprocess.run([sys.executable, str(script), "--model", str(tiny_model_dir), "--budget",
                    "2048", "--host-budget-mb", "0.5", "--recall-tokens", "128",
                    "--tolerance", "100", "--out", str(out)], check=True, timeout=600)
    figures = json.loads(out.read_text())
    assert figures["recalled_chunks"] >= 1 and figures["recall_tokens"] == 128
    assert 0.4 * 2**20 < figures["tier_host_bytes"] <= 0.5 * 2**20  # full, within its budget
    assert figures["plan"]["host_tier_bytes"] == 0.5 * 2**20
    assert figures["peak_added"] > 0
