"""An hour through the node: a 60-minute busy stream through the memory node at a 1-2 % budget.

Why: the engine's hour (bench/bounded_memory.py) leaves out everything a robot runs around it:
DDS, the camera callback and sampler, the worker queue, questions arriving while chunks stream
in. Here the installed memory_node with the shipped scene model takes a whole hour of camera over
DDS and must keep every chunk, stay flat in time and memory once its budget is full, and answer
a question every 5 minutes.

How: a busy-world stream (`scenes.SceneStream` with `BUSY`'s options, --objects identities in
the hour: the frames of `deltas-ros synth --busy`, rendered here as they are published) goes out
at 4 fps of stream time as sensor_msgs/Image (128x96 rgb8, reliable) with /clock beside it, paced
at --speed x real time; the node runs on use_sim_time, as under `deltas-ros replay --clock`.
A short probe node first reports the chunk size (DriftScore.chunk_tokens); the budget M is then
--budget-share of the hour's tokens, the window M/8, 4 buckets, the node's default sinks and
policy. Every --question-every seconds of stream time "Did you see a <colour> <shape>?" is asked
over AskMemory about the object most recently shown in that stretch (the newest shown before it
if none was), without holding up the camera. Recorded: every DriftScore (per-chunk forward +
signal + evict ms, KV tokens), the node's VmRSS (/proc) once a wall second with the newest chunk's
stream time, the questions' latency and verdicts, and the node's /diagnostics counts at the end
(processed, dropped, discarded). Checks: no chunk dropped or lost, per-chunk median time in the
last third of the chunks after the budget is reached within 1.2x the first third's, RSS at the
end within 5 % of RSS when the budget was reached, every question answered.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.hour_node --speed 6
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.hour_node --smoke --out /tmp/hour   # seconds

Honest limits: one stream, one run; camera, node and this listener share the machine's cores,
so a loaded machine shows in the per-chunk times (its load average is in the results).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from math import nan
from pathlib import Path
from typing import Any

import numpy as np
import rclpy
from deltas_ros.msg import DriftScore
from deltas_ros.srv import AskMemory
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import SingleThreadedExecutor
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Image

from deltas_ros.core.config import DEFAULT_NODE
from deltas_ros.ros.messages import to_time_msg
from deltas_ros.ros.node import NOT_READY
from deltas_ros.training.questions import QA, TEMPLATES, answer_for, is_correct
from deltas_ros.training.scenes import BUSY, SceneStream

from .bounded_memory import rss_bytes
from .common import (
    DEFAULT_OUT,
    add_out_arg,
    finish,
    isolate_ros,
    md_table,
    median,
    memory_node_command,
    percentile,
    ros_setup,
    start_results,
    stop_process,
    verdict,
)

TOPIC = "/bench/camera/image_raw"
CAMERA_FPS = 4.0  # twice the node's 2 fps sampler, as test_soak streams
BASE_STAMP = 1_700_000_000.0
ACCOUNTED = ("chunks_processed", "chunks_dropped", "chunks_discarded")
READY_TIMEOUT_S = 180.0
TIME_RATIO_MAX = 1.2
RSS_GROWTH_MAX = 0.05


class Camera:
    """This process's side of the graph: the camera and /clock, ~/drift, /diagnostics and the
    AskMemory client, spun on one thread."""

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node("bench_hour_node", context=self.context)
        self.lock = threading.Lock()
        self.drift: list[DriftScore] = []
        self.diagnostics: dict[str, str] = {}
        self.published_s = 0.0  # stream time of the newest frame published
        self.camera = self.node.create_publisher(Image, TOPIC, 50)
        self.clock = self.node.create_publisher(Clock, "/clock", 10)
        self.node.create_subscription(DriftScore, f"{DEFAULT_NODE}/drift", self._on_drift, 200)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)
        self.ask_client = self.node.create_client(AskMemory, f"{DEFAULT_NODE}/ask_memory")
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_drift(self, msg: DriftScore) -> None:
        with self.lock:
            self.drift.append(msg)

    def _on_diag(self, msg: DiagnosticArray) -> None:
        values = {kv.key: kv.value for kv in msg.status[0].values} if msg.status else {}
        with self.lock:
            self.diagnostics = values

    def accounted(self) -> int:
        with self.lock:
            return sum(int(self.diagnostics.get(key, 0)) for key in ACCOUNTED)

    def ask(self, question: str) -> Any:
        """The request's future (the caller polls it: the camera must not wait for it)."""
        return self.ask_client.call_async(AskMemory.Request(question=question))

    def wait_ready(self, node: subprocess.Popen) -> None:
        """Until the model is loaded (a blank question refused, but not as "not ready") and the
        node's subscription has matched the camera: frames sent before that are lost."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if node.poll() is not None:
                raise RuntimeError("the node exited before it was ready")
            if self.ask_client.service_is_ready() and self.camera.get_subscription_count():
                future = self.ask(" ")
                if wait(future.done, 10) and future.result().error != NOT_READY:
                    return
            time.sleep(0.1)
        raise RuntimeError("the node did not come up")

    def stream(self, scene: SceneStream, speed: float, stop: threading.Event) -> None:
        """Publish the scene at CAMERA_FPS by stamp, paced at `speed` x real time."""
        wall0 = time.monotonic()
        for i in range(int(scene.duration_s * CAMERA_FPS)):
            if stop.is_set():
                return
            t = i / CAMERA_FPS
            pixels = scene.frame(t, i)
            msg = Image(height=scene.height, width=scene.width, encoding="rgb8",
                        step=scene.width * 3, data=pixels.tobytes())
            msg.header.stamp = to_time_msg(BASE_STAMP + t)
            msg.header.frame_id = "camera"
            self.camera.publish(msg)
            self.clock.publish(Clock(clock=to_time_msg(BASE_STAMP + t)))
            self.published_s = t
            delay = wall0 + (i + 1) / CAMERA_FPS / speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self.thread.join(5)


def wait(predicate, timeout: float) -> bool:
    """Poll `predicate` until it holds or `timeout` s pass; whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_node(overrides: dict[str, Any], log: Path) -> subprocess.Popen:
    """The node, its output to `log` (an hour of log lines would fill a pipe and stall it)."""
    with log.open("w") as out:
        return subprocess.Popen(memory_node_command(overrides), stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def question_about(scene: SceneStream, start: float, end: float) -> dict[str, Any]:
    """"Did you see a ...?" about the object whose view ended last in [start, end), else the
    newest shown before `end`; its true answer from the events shown by then."""
    events = [e for e in scene.events() if e["kind"] == "object" and e["end"] < end]
    inside = [e for e in events if e["end"] >= start]
    target = max(inside or events, key=lambda e: e["end"])
    question = TEMPLATES["seen"].format(colour=target["colour"], shape=target["shape"])
    truth = answer_for("seen", [e for e in scene.events() if e["time"] < end],
                       colour=target["colour"], shape=target["shape"])
    return {"stream_s": end, "question": question, "truth": truth,
            "shown_ago_s": round(end - target["end"], 1), "in_stretch": bool(inside)}


def chunk_tokens_of(scene: SceneStream, overrides: dict[str, Any], log: Path) -> int:
    """The chunk size the node reports for this stream (median of the probe's chunks), from a
    probe node run on the stream's first seconds."""
    node = start_node(overrides, log)
    camera = Camera()
    try:
        camera.wait_ready(node)
        probe = SceneStream(6.0, scene.width, scene.height, 0, scene.options)
        camera.stream(probe, 4.0, threading.Event())
        if not wait(lambda: len(camera.drift) >= 4, 60):
            raise RuntimeError(f"the probe node reported no chunks: {log.read_text()[-3000:]}")
        with camera.lock:
            return int(median([m.chunk_tokens for m in camera.drift]))
    finally:
        camera.close()
        stop_process(node)


def run(args: argparse.Namespace, scratch: Path, out: Path) -> dict[str, Any]:
    options = replace(BUSY, objects=(args.objects, args.objects))
    scene = SceneStream(args.seconds, args.width, args.height, args.seed, options)
    base = {"image_topic": TOPIC, "use_sim_time": "true", "reliable_qos": "true",
            "device": "cpu", "silence_warn_s": "30.0", "memory_dir": str(scratch)}
    chunk_tokens = chunk_tokens_of(scene, base, scratch / "probe.log")
    chunks = int(args.seconds)  # 2 fps, 2 frames per chunk: one chunk per stream second
    budget = round(args.budget_share * chunks * chunk_tokens)
    config = {"budget_tokens": budget, "window_tokens": budget // 8, "buckets": 4}
    log = scratch / "node.log"
    node = start_node(base | config, log)
    camera = Camera()
    rss: list[tuple[float, float, int]] = []  # (wall s, newest chunk's stream s, bytes)
    questions: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        camera.wait_ready(node)
        feeder = threading.Thread(target=camera.stream, args=(scene, args.speed, stop),
                                  daemon=True)
        wall0 = time.monotonic()
        feeder.start()
        next_question, pending, last_rss = args.question_every, None, -1.0
        while True:
            # The last frame is a frame period before the stream's end: asked with it, also
            # when the camera has finished by the time this loop looks.
            due = camera.published_s + 1 / CAMERA_FPS >= next_question <= args.seconds
            if not (feeder.is_alive() or pending or due):
                break
            if node.poll() is not None:
                raise RuntimeError(f"the node exited: {log.read_text()[-3000:]}")
            now = time.monotonic() - wall0
            if now - last_rss >= 1.0:
                with camera.lock:
                    stream_s = camera.drift[-1].stream_time if camera.drift else 0.0
                rss.append((now, stream_s, rss_bytes(node.pid)))
                last_rss = now
            if pending is None and due:
                asked = question_about(scene, next_question - args.question_every,
                                       next_question)
                pending = (asked, camera.ask(asked["question"]), time.monotonic())
                next_question += args.question_every
            if pending and pending[1].done():
                asked, future, sent = pending
                reply = future.result()
                asked |= {"success": reply.success, "answer": reply.answer,
                          "error": reply.error, "node_latency_ms": reply.latency_ms,
                          "wall_latency_ms": (time.monotonic() - sent) * 1e3,
                          "memory_tokens": reply.memory_tokens,
                          "correct": reply.success and is_correct(
                              QA("seen", asked["question"], asked["truth"]), reply.answer)}
                questions.append(asked)
                pending = None
            elif pending and time.monotonic() - pending[2] > 180:
                raise RuntimeError(f"no answer in 180 s to {pending[0]['question']!r}")
            time.sleep(0.05)
        stream_wall = time.monotonic() - wall0
        # Every chunk processed, dropped or discarded; the last may be incomplete.
        wait(lambda: camera.accounted() >= chunks - 1, 120)
        wait(lambda: len(camera.drift) >= int(camera.diagnostics.get("chunks_processed", 0))
             and camera.accounted() >= chunks - 1, 30)
        rss.append((time.monotonic() - wall0, camera.drift[-1].stream_time,
                    rss_bytes(node.pid)))
        with camera.lock:
            drift, values = list(camera.drift), dict(camera.diagnostics)
    finally:
        stop.set()
        camera.close()
        stop_process(node)
    return summarize(drift, values, rss, questions, chunks, chunk_tokens, config,
                     stream_wall) | {"plot": plot(drift, rss, questions, out)}


def summarize(drift: list[DriftScore], values: dict[str, str],
              rss: list[tuple[float, float, int]], questions: list[dict[str, Any]],
              chunks: int, chunk_tokens: int, config: dict[str, Any],
              stream_wall: float) -> dict[str, Any]:
    budget = config["budget_tokens"]
    times = [m.forward_ms + m.signal_ms + m.evict_ms for m in drift]
    full = next((i for i, m in enumerate(drift) if m.evicted_tokens > 0), len(drift))
    after = times[full:]
    third = len(after) // 3
    first, last = (median(after[:third]), median(after[-third:])) if third else (nan, nan)
    reached_s = drift[full].stream_time if full < len(drift) else float("inf")
    baseline = next((b for _, s, b in rss if s >= reached_s), None)
    after_rss = [b for _, s, b in rss if s >= reached_s]
    indices = [m.chunk_index for m in drift]
    total_tokens = sum(m.chunk_tokens for m in drift)
    return {
        "chunks_expected": chunks,
        "chunks_processed": int(values.get("chunks_processed", 0)),
        "chunks_dropped": int(values.get("chunks_dropped", 0)),
        "chunks_discarded": int(values.get("chunks_discarded", 0)),
        "chunks_failed": int(values.get("chunks_failed", 0)),
        "drift_messages": len(drift),
        "index_gaps": sum(b - a - 1 for a, b in zip(indices, indices[1:])),
        "probe_chunk_tokens": chunk_tokens, "config": config,
        "stream_tokens": total_tokens,
        "budget_share_actual": budget / total_tokens if total_tokens else float("nan"),
        "max_kv_tokens": max(m.kv_tokens for m in drift),
        "budget_reached": {"chunk": full, "stream_s": reached_s},
        "chunk_ms": {"median": median(times), "p95": percentile(times, 95), "max": max(times),
                     "after_budget_first_third_median": first,
                     "after_budget_last_third_median": last, "ratio": last / first},
        "real_time_factor": sum(times) / 1e3 / max(drift[-1].stream_time, 1e-9),
        "rss_mib": {"at_budget": baseline / 2**20 if baseline else None,
                    "end": rss[-1][2] / 2**20,
                    "max_after_budget": max(after_rss) / 2**20 if after_rss else None,
                    "growth_end": rss[-1][2] / baseline - 1 if baseline else None,
                    "growth_max": max(after_rss) / baseline - 1 if baseline else None},
        "position": values.get("position"),
        "stream_wall_s": stream_wall,
        "questions": questions,
        "rss_samples": [[round(w, 1), round(s, 1), b] for w, s, b in rss],
        "chunk_samples": [[m.chunk_index, round(m.stream_time, 1), round(t, 2), m.kv_tokens]
                          for m, t in zip(drift, times)],
    }


def plot(drift: list[DriftScore], rss: list[tuple[float, float, int]],
         questions: list[dict[str, Any]], out: Path) -> str:
    """Per-chunk time and RSS over stream time, the budget reached and the questions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = np.array([m.stream_time for m in drift]) / 60
    times = np.array([m.forward_ms + m.signal_ms + m.evict_ms for m in drift])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    top.plot(minutes, times, ".", ms=1.5, alpha=0.4, label="per chunk")
    window = min(60, len(times))
    rolling = np.convolve(times, np.ones(window) / window, mode="valid")
    top.plot(minutes[window - 1:], rolling, lw=1.5, label=f"mean of {window} chunks")
    top.set_ylabel("forward + signal + evict, ms")
    top.set_ylim(0, float(np.percentile(times, 99.5)) * 1.2)
    bottom.plot([s / 60 for _, s, _ in rss], [b / 2**20 for _, _, b in rss], lw=1.2)
    bottom.set_ylabel("node RSS, MiB")
    bottom.set_xlabel("stream time, minutes")
    full = next((m.stream_time for m in drift if m.evicted_tokens > 0), None)
    for axis in (top, bottom):
        if full is not None:
            axis.axvline(full / 60, color="grey", ls="--", lw=0.8)
        for q in questions:
            axis.axvline(q["stream_s"] / 60, color="tab:green", lw=0.5, alpha=0.5)
    top.legend(loc="upper right", fontsize=8)
    top.set_title("The memory node over the stream (dashed: budget reached; green: questions)",
                  fontsize=9)
    fig.tight_layout()
    path = out / "hour_node.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def report(r: dict[str, Any], args: argparse.Namespace) -> str:
    ms, mib, config = r["chunk_ms"], r["rss_mib"], r["config"]
    answered = sum(q["success"] for q in r["questions"])
    asked = len(r["questions"])
    wanted = int(args.seconds // args.question_every)
    lat = [q["wall_latency_ms"] for q in r["questions"] if q["success"]]
    lost = r["chunks_expected"] - r["chunks_processed"] - r["chunks_dropped"] - r[
        "chunks_discarded"]
    table = md_table(["quantity", "value"], [
        ["stream; wall time of the stream", f"{args.seconds / 60:.1f} min at {args.speed:g}x; "
         f"{r['stream_wall_s']:.0f} s"],
        ["chunks expected / processed / dropped / discarded / failed",
         f"{r['chunks_expected']} / {r['chunks_processed']} / {r['chunks_dropped']} / "
         f"{r['chunks_discarded']} / {r['chunks_failed']}"],
        ["chunk tokens (probe); the stream's tokens",
         f"{r['probe_chunk_tokens']}; {r['stream_tokens']:,}"],
        ["budget M, window, buckets; M / the stream's tokens",
         f"{config['budget_tokens']}, {config['window_tokens']}, {config['buckets']}; "
         f"{100 * r['budget_share_actual']:.2f} %"],
        ["max KV tokens; budget reached at", f"{r['max_kv_tokens']}; chunk "
         f"{r['budget_reached']['chunk']} ({r['budget_reached']['stream_s']:.0f} s)"],
        ["per-chunk forward + signal + evict (median / p95 / max)",
         f"{ms['median']:.1f} / {ms['p95']:.1f} / {ms['max']:.1f} ms"],
        ["real-time factor (processing / stream time)", f"{r['real_time_factor']:.3f}"],
        ["node RSS at the budget -> end (max after)",
         f"{mib['at_budget']:.1f} -> {mib['end']:.1f} MiB ({mib['max_after_budget']:.1f})"],
        ["questions answered / asked; latency median / max",
         f"{answered} / {asked}; {median(lat):.0f} / {max(lat, default=float('nan')):.0f} ms"],
        ["position counter at the end", str(r["position"])],
    ])
    checks = md_table(["check", "measured", "target", "result"], [
        ["no chunk dropped or lost", f"{r['chunks_dropped']} dropped, {lost} unaccounted, "
         f"{r['index_gaps']} index gaps", "0", verdict(
             r["chunks_dropped"] == 0 and lost <= 1 and r["index_gaps"] == 0)],
        ["per-chunk median, last / first third after the budget",
         f"{ms['after_budget_last_third_median']:.1f} / "
         f"{ms['after_budget_first_third_median']:.1f} ms = {ms['ratio']:.2f}x",
         f"<= {TIME_RATIO_MAX}x", verdict(ms["ratio"] <= TIME_RATIO_MAX)],
        ["node RSS, end / at the budget", f"{100 * mib['growth_end']:+.2f} % "
         f"(max {100 * mib['growth_max']:+.2f} %)", f"< +{100 * RSS_GROWTH_MAX:.0f} %",
         verdict(mib["growth_end"] < RSS_GROWTH_MAX)],
        ["every question answered", f"{answered} of {wanted}", f"{wanted}",
         verdict(answered == asked == wanted)],
    ])
    rows = [[f"{q['stream_s']:.0f}", q["question"], f"{q['shown_ago_s']:.0f}",
             q["answer"] or q["error"], "yes" if q["correct"] else "no",
             f"{q['wall_latency_ms']:.0f}", q["memory_tokens"]] for q in r["questions"]]
    answers = md_table(["stream s", "question", "shown s before", "answer", "right",
                        "latency ms", "memory tokens"], rows)
    return (f"{table}\n{checks}\n{answers}\n"
            f"![per-chunk time and RSS over the stream](hour_node.png)\n\n"
            f"The installed memory_node with the shipped scene model, use_sim_time on a /clock "
            f"published with the frames; a busy-world stream (seed {args.seed}, "
            f"{args.objects} identities) of {args.width}x{args.height} rgb8 at "
            f"{CAMERA_FPS:g} fps of stream time over DDS (reliable), paced at {args.speed:g}x; "
            "questions over AskMemory while the stream runs (\"right\": the verdict against the "
            "truth; where no object was shown in the "
            f"{args.question_every:g} s before a question it is about the newest shown "
            "before). Camera, node and this listener share the machine's "
            "cores.\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="stream seconds")
    parser.add_argument("--speed", type=float, default=6.0,
                        help="stream seconds per wall second")
    parser.add_argument("--budget-share", type=float, default=0.02,
                        help="M as a share of the stream's tokens")
    parser.add_argument("--question-every", type=float, default=300.0,
                        help="stream seconds between questions")
    parser.add_argument("--objects", type=int, default=24,
                        help="colour-shape identities shown in the stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--smoke", action="store_true",
                        help="2 minutes of stream at 8x, M at 20 %%, a question every 30 s")
    add_out_arg(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.speed, args.budget_share = 120.0, 8.0, 0.2
        args.question_every, args.objects = 30.0, 8
    out = args.out / "hour_node" if args.out == DEFAULT_OUT else args.out  # a folder of its own
    out.mkdir(parents=True, exist_ok=True)

    isolate_ros()
    results = start_results("hour_node", argv)
    results |= {"ros": ros_setup(), "seconds": args.seconds, "speed": args.speed,
                "budget_share": args.budget_share, "question_every_s": args.question_every,
                "objects": args.objects, "seed": args.seed, "size": [args.width, args.height],
                "camera_fps": CAMERA_FPS, "model": "shipped scene model",
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as scratch:
        results["run"] = run(args, Path(scratch), out)
    return finish(out, results, f"An hour through the node: {args.seconds / 60:.1f} min of "
                  f"busy stream at {args.speed:g}x, M = {100 * args.budget_share:g} % of its "
                  "tokens, the shipped model", report(results["run"], args))


if __name__ == "__main__":
    main()
