"""Offline runs (`deltas-ros run`, `deltas-ros plot`) on the tiny model, CPU only.

The key check: a bag run offline and the same bag replayed to the live node (started as the launch
file starts it) give the same chunks, stream times and drift, because both are one engine path.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import subprocess
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from ros_helpers import Tester as NodeTester  # not "Test*": pytest would try to collect it
from ros_helpers import node_command, stop

from deltas_ros.core.decode import FrameError
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.ros.replay import replay_bag
from deltas_ros.tools import cli
from deltas_ros.tools.bag import load_events, open_images
from deltas_ros.tools.offline import open_source, read_results, run_stream
from deltas_ros.training.synth import synth_stream, write_synth_bag

TOPIC = "/camera/image_raw"
SECONDS, FPS = 6, 10.0
# Small enough that the cache overflows within the bag, so eviction is part of every comparison.
NODE_SMALL = {"pixel_budget": "4096", "budget_tokens": "64", "window_tokens": "24"}
SMALL_ARGS = ["--pixel-budget", "4096", "--budget", "64", "--window", "24", "--quiet"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str | Path) -> tuple[int, str]:
    """cli.main in this process; its exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def bag(tmp_path_factory) -> Path:
    """6 s at 10 fps with one known event (an object from about 2 s on)."""
    path = tmp_path_factory.mktemp("offline") / "bag"
    return write_synth_bag(path, duration_s=SECONDS, fps=FPS, width=160, height=120,
                           event_every_s=2.5)


@pytest.fixture(scope="module")
def deltas_run(bag, tiny_model_dir, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("results") / "deltas.jsonl"
    # DeltaS keeps or drops chunks whole: some of the 6 are then surely gone.
    code, stdout = run_cli("run", bag, "--model", tiny_model_dir, "--out", out, *SMALL_ARGS,
                           "--policy", "deltas", "--ask", "What appeared?",
                           "--ask", "Which colour?", "--max-new-tokens", "3")
    assert code == 0
    return out, stdout


def test_run_on_a_bag_writes_one_record_per_second(deltas_run, bag, tiny_model_dir):
    out, stdout = deltas_run
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    meta, chunks, summary = lines[0], lines[1:-1], lines[-1]
    assert meta["type"] == "meta" and summary["type"] == "summary"
    assert {c["type"] for c in chunks} == {"chunk"}
    assert meta["policy"] == "deltas" and meta["budget_tokens"] == 64
    assert meta["model"] == str(tiny_model_dir) and meta["source"]["kind"] == "bag"
    assert meta["source"]["topic"] == TOPIC and meta["events"] == load_events(bag)
    assert meta["events"]  # the plot test shades it

    assert [c["chunk_index"] for c in chunks] == list(range(SECONDS))
    assert [c["stream_time"] for c in chunks] == [i + 0.25 for i in range(SECONDS)]
    assert [c["stamp"] for c in chunks] == pytest.approx(
        [1_700_000_000.5 + i for i in range(SECONDS)])
    assert all(math.isfinite(c["drift"]) and len(c["layer_drift"]) == 6 for c in chunks)
    assert all(c["kv_tokens"] <= 64 for c in chunks) and chunks[-1]["evicted_tokens"] > 0

    assert summary["frames"] == SECONDS * FPS and summary["sampled"] == 2 * SECONDS
    assert summary["chunks"] == SECONDS and summary["bad_frames"] == summary["resets"] == 0
    held = summary["retained_chunks"]
    assert 0 < len(held) < SECONDS and set(held) <= set(range(SECONDS))
    assert summary["retained_times"] == [i + 0.25 for i in held]
    assert [a["question"] for a in summary["answers"]] == ["What appeared?", "Which colour?"]
    for answer in summary["answers"]:
        assert set(answer["evidence_times"]) <= set(summary["retained_times"])
        assert answer["latency_ms"] > 0
    assert "Q: What appeared?" in stdout and "evidence at" in stdout and str(out) in stdout


def test_csv_results_and_a_plot_comparing_two_policies(deltas_run, bag, tiny_model_dir,
                                                       tmp_path):
    recency = tmp_path / "recency.csv"
    code, _ = run_cli("run", bag, "--model", tiny_model_dir, "--out", recency,
                      "--policy", "recency", *SMALL_ARGS)
    assert code == 0
    lines = recency.read_text().splitlines()
    assert lines[0].startswith("# meta {") and lines[-1].startswith("# summary {")
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert [int(r["chunk_index"]) for r in rows] == list(range(SECONDS))
    assert all(len(r["layer_drift"].split(";")) == 6 for r in rows)
    results = read_results(recency)
    assert results.meta["policy"] == "recency" and results.summary["chunks"] == SECONDS
    # Before the first eviction both policies hold the same cache, so the same drift.
    deltas = read_results(deltas_run[0])
    assert results.chunks[0]["drift"] == pytest.approx(deltas.chunks[0]["drift"], rel=1e-6)

    png = tmp_path / "compare.png"
    code, stdout = run_cli("plot", deltas_run[0], recency, "--out", png)
    assert code == 0 and str(png) in stdout
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and 10_000 < len(data) < 500_000


class NoFrameRate:
    """A capture whose container reports no frame rate.

    It wraps a real one: Python subclasses of cv2.VideoCapture crash the garbage collector.
    """

    def __init__(self, path: str, capture=cv2.VideoCapture) -> None:  # bound before patching
        self._capture = capture(path)

    def get(self, prop: int) -> float:
        return 0.0 if prop == cv2.CAP_PROP_FPS else self._capture.get(prop)

    def __getattr__(self, name: str):
        return getattr(self._capture, name)


def test_run_on_a_video_file(tiny_model_dir, tmp_path, monkeypatch, caplog):
    video = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (160, 120))
    assert writer.isOpened()
    frames, _ = synth_stream(3.0, 10.0, 160, 120)
    for _, frame in frames:
        writer.write(np.ascontiguousarray(frame[..., ::-1]))
    writer.release()

    out = tmp_path / "video.jsonl"
    code, stdout = run_cli("run", video, "--model", tiny_model_dir, "--out", out, *SMALL_ARGS)
    assert code == 0, stdout
    results = read_results(out)
    assert results.meta["source"]["kind"] == "video" and results.meta["source"]["video_fps"] == 10
    assert [c["chunk_index"] for c in results.chunks] == [0, 1, 2]
    assert [c["stamp"] for c in results.chunks] == pytest.approx([0.5, 1.5, 2.5])
    assert results.summary["frames"] == 30 and results.summary["sampled"] == 6
    assert [t for t, _ in open_source(video).frames] == pytest.approx([i / 10 for i in range(30)])

    monkeypatch.setattr(cv2, "VideoCapture", NoFrameRate)
    assert [t for t, _ in open_source(video).frames] == pytest.approx([i / 30 for i in range(30)])
    assert "reports no frame rate; assuming 30 fps" in caplog.text


def test_run_stream_decodes_only_sampled_frames_and_resets_on_jump_back(tiny_model):
    memory = StreamingMemory(tiny_model, MemoryConfig(budget_tokens=64, window_tokens=24,
                                                      pixel_budget=4096))
    frames = list(synth_stream(3.0, 10.0, 64, 48)[0])
    decoded: list[float] = []

    def camera(start: float):
        for t, frame in frames:
            def decode(stamp: float = start + t, frame: np.ndarray = frame) -> np.ndarray:
                decoded.append(stamp)
                return frame
            yield start + t, decode

    def corrupt() -> np.ndarray:
        raise FrameError("corrupt frame")

    # 3 s of stream, a corrupt frame in the next sampling slot, then the stamps jump back.
    source = [*camera(100.0), (103.0, corrupt), *camera(50.0)]
    summary = run_stream(memory, source)
    assert summary.frames == 61 and summary.resets == 1
    assert [r.chunk_index for r in summary.records] == [0, 1, 2, 0, 1, 2]
    # Only sampled frames: the evidence for the jump decodes only what the new stream samples.
    assert len(decoded) == summary.sampled == 12
    assert summary.bad_frames == 1 and summary.bad_frame_reasons == {"corrupt frame": 1}
    assert memory.stats().chunks == 3  # the memory restarted with the second stream
    assert summary.retained_times and max(summary.retained_times) < 3


@pytest.mark.parametrize("case", ["missing", "random.mp4", "not_a_bag", "wrong_topic"])
def test_unreadable_input_is_a_one_line_error(case, bag, tiny_model_dir, tmp_path, capsys):
    path, extra = tmp_path / case, []
    if case == "random.mp4":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif case == "not_a_bag":
        path.mkdir()
        (path / "frames.txt").write_text("no metadata.yaml here")
    elif case == "wrong_topic":
        path, extra = bag, ["--topic", "/camera/depth"]
    code = cli.main(["run", str(path), "--model", str(tiny_model_dir), *extra,
                     "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("deltas-ros run: error:") and str(path) in err[0]
    assert not (tmp_path / "out.jsonl").exists()


def test_offline_run_and_the_live_node_are_one_engine(deltas_run, bag, tiny_model_dir, ros_env):
    offline = read_results(deltas_run[0]).chunks
    command = node_command(tiny_model_dir, TOPIC, reliable_qos="true", policy="deltas",
                           **NODE_SMALL)
    process = subprocess.Popen(command, env=ros_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    tester = NodeTester(topic=TOPIC)
    try:
        tester.wait_ready(process)
        replay_bag(open_images(bag), rate=1.0)
        # A fresh node's first chunks pay one-time costs: minutes on a loaded 2-core machine.
        tester.wait_for(lambda: len(tester.drift) >= len(offline), timeout=120)
        time.sleep(0.5)  # anything extra would arrive now
    finally:
        tester.close()
        _, err = stop(process)  # a clean exit is test_node's concern
    live = tester.drift
    assert [m.chunk_index for m in live] == [c["chunk_index"] for c in offline], err[-3000:]
    assert [m.stream_time for m in live] == [c["stream_time"] for c in offline]
    assert [m.drift for m in live] == pytest.approx([c["drift"] for c in offline], rel=1e-5)
    for message, chunk in zip(live, offline):
        assert list(message.layer_drift) == pytest.approx(chunk["layer_drift"], rel=1e-5)
        assert (message.chunk_tokens, message.kv_tokens, message.evicted_tokens) == (
            chunk["chunk_tokens"], chunk["kv_tokens"], chunk["evicted_tokens"])
        stamp = message.header.stamp.sec + message.header.stamp.nanosec * 1e-9
        assert stamp == pytest.approx(chunk["stamp"], abs=1e-6)
