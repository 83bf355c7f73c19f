"""End to end: the real node, fed a 30 fps camera, from a chunk's last frame to its DriftScore.

Why: the engine's own timings leave out everything around it: DDS transport of 30 frames a
second, the camera callback and sampling, the worker queue, publishing the result. The latency a
planner sees, and whether the node keeps up with the stream, are measured here on the real node.

How: the installed memory_node executable is started exactly as launch/deltas.launch.py starts it
(config/deltas.yaml plus overrides: the model, the topic, reliable QoS, a small budget so that
evictions happen, device cpu). A camera process (bench.camera_pub) publishes --seconds of frames
and logs each frame's publish wall time; this process listens to ~/drift. Latency of a chunk =
arrival wall time of its DriftScore - publish wall time of the frame whose stamp the DriftScore
carries (the chunk's last sampled frame). Real-time factor = the node's processing time
(forward + signal + evict of each DriftScore) summed / stream time those chunks cover (1 s each);
below 1 the node keeps up. The node process's CPU (/proc/PID/stat) over the stream is reported too.

--dashboard: the same stream twice in one invocation, through a fresh node each time: the node
alone, then with `deltas-ros dashboard` attached and one page open on it (bench.dashboard_page),
side by side, with the dashboard process's CPU; written as end_to_end_dashboard.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import rclpy
from deltas_ros.msg import DriftScore
from deltas_ros.srv import AskMemory
from rclpy.executors import SingleThreadedExecutor

from deltas_ros.core.config import DEFAULT_NODE
from deltas_ros.core.model_maker import make_model
from deltas_ros.ros.node import NOT_READY
from deltas_ros.training.synth import NS_PER_S

from .common import (
    add_camera_args,
    finish,
    md_table,
    median,
    memory_node_command,
    percentile,
    start_ros_run,
    stop_process,
    stream_camera,
)
from .dashboard_page import DashboardPage

TOPIC = "/bench/camera/image_raw"
DRIFT_TOPIC = f"{DEFAULT_NODE}/drift"
ASK_SERVICE = f"{DEFAULT_NODE}/ask_memory"
CHUNK_S = 1.0  # two frames at 2 fps
READY_TIMEOUT_S = 600.0  # a 9B model takes minutes to load from a cold disk


def node_command(model_dir: Path, args: argparse.Namespace) -> list[str]:
    """The command launch/deltas.launch.py runs, with this benchmark's overrides."""
    overrides = {"model_path": model_dir, "image_topic": TOPIC, "use_sim_time": "false",
                 "reliable_qos": "true", "device": "cpu", "budget_tokens": args.budget,
                 "window_tokens": args.window, "pixel_budget": args.pixel_budget}
    return memory_node_command(overrides)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Listener:
    """DriftScore messages with their arrival wall times."""

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node("bench_end_to_end", context=self.context)
        self.lock = threading.Lock()
        self.arrivals: list[tuple[DriftScore, float]] = []
        self.node.create_subscription(DriftScore, DRIFT_TOPIC, self.on_drift, 100)
        self.ask_client = self.node.create_client(AskMemory, ASK_SERVICE)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def on_drift(self, msg: DriftScore) -> None:
        arrival = time.time()
        with self.lock:
            self.arrivals.append((msg, arrival))

    def node_ready(self) -> bool:
        """Whether the model is loaded: a blank question is refused, but not as "not ready"."""
        if not self.ask_client.service_is_ready():
            return False
        future = self.ask_client.call_async(AskMemory.Request(question=" "))
        deadline = time.monotonic() + 10.0
        while not future.done():
            if time.monotonic() > deadline:
                return False  # no answer yet: the node is busy loading; ask again
            time.sleep(0.05)
        return future.result().error != NOT_READY

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self.thread.join(5)


def run(model_dir: Path, args: argparse.Namespace, log: Path,
        page: bool = False) -> dict[str, Any]:
    """One stream through a fresh node; with `page`, `deltas-ros dashboard` attached to it and
    one page open on the dashboard (bench.dashboard_page)."""
    node = subprocess.Popen(node_command(model_dir, args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    listener = Listener()
    dashboard = None
    err = ""
    try:
        # Frames that come before the model is loaded are dropped: start the camera after.
        listener.wait(lambda: node.poll() is not None or listener.node_ready(),
                      READY_TIMEOUT_S, "the node to load the model")
        if node.poll() is not None:
            raise RuntimeError(f"the node exited: {node.stderr.read()[-3000:]}")
        if page:
            dashboard = DashboardPage()
            dash_cpu0 = cpu_seconds(dashboard.pid)
        cpu0, wall0 = cpu_seconds(node.pid), time.monotonic()
        published = stream_camera(args, TOPIC, "rgb8", "--log", str(log))
        expected = int(args.seconds / CHUNK_S)
        try:
            listener.wait(lambda: len(listener.arrivals) >= expected, 60, "the last chunks")
        except RuntimeError:
            pass  # dropped chunks are reported, not fatal
        wall = time.monotonic() - wall0
        node_cpu = (cpu_seconds(node.pid) - cpu0) / wall
        if dashboard:
            attached = {"dashboard_cpu_cores": (cpu_seconds(dashboard.pid) - dash_cpu0) / wall,
                        "page_events": dict(dashboard.events),
                        "page_images_fetched": dashboard.images_fetched}
    finally:
        if dashboard:
            dashboard.close()
        listener.close()
        err = stop_process(node)
    if not listener.arrivals:
        raise RuntimeError(f"no DriftScore arrived; node stderr: {err[-3000:]}")
    result = summarize(listener.arrivals, published, log, expected, node_cpu)
    return result | attached if page else result


def summarize(arrivals: list[tuple[DriftScore, float]], published: dict[str, Any], log: Path,
              expected: int, node_cpu: float) -> dict[str, Any]:
    sent = {round(ns / 1e6): wall for ns, wall in json.loads(log.read_text())}
    latency, processing = [], []
    for msg, arrival in arrivals:
        ns = msg.header.stamp.sec * NS_PER_S + msg.header.stamp.nanosec
        latency.append((arrival - sent[round(ns / 1e6)]) * 1e3)
        processing.append(msg.forward_ms + msg.signal_ms + msg.evict_ms)
    indices = [msg.chunk_index for msg, _ in arrivals]
    last = arrivals[-1][0]
    return {
        "frames_published": published["published"], "chunks_expected": expected,
        "chunks_received": len(arrivals),
        "chunks_missing": expected - len(set(indices)),
        "latency_ms": {"median": median(latency), "p95": percentile(latency, 95),
                       "max": max(latency)},
        "processing_ms": {"median": median(processing), "p95": percentile(processing, 95)},
        "real_time_factor": sum(processing) / 1e3 / (len(arrivals) * CHUNK_S),
        "latency_per_chunk_interval": median(latency) / 1e3 / CHUNK_S,
        "node_cpu_cores": node_cpu,
        "kv_tokens_end": last.kv_tokens,
        "evicting_chunks": sum(msg.evicted_tokens > 0 for msg, _ in arrivals),
        "chunk_tokens": median([msg.chunk_tokens for msg, _ in arrivals]),
    }


def rows(r: dict[str, Any], budget: int) -> list[list[str]]:
    """One run's table rows: [quantity, value]."""
    lat, proc = r["latency_ms"], r["processing_ms"]
    table = [
        ["chunks expected / received / missing",
         f"{r['chunks_expected']} / {r['chunks_received']} / {r['chunks_missing']}"],
        ["latency, last frame published -> DriftScore arrived (median / p95 / max)",
         f"{lat['median']:.1f} / {lat['p95']:.1f} / {lat['max']:.1f} ms"],
        ["node processing per chunk, forward + signal + evict (median / p95)",
         f"{proc['median']:.1f} / {proc['p95']:.1f} ms"],
        ["real-time factor: processing / stream time", f"{r['real_time_factor']:.3f}"],
        ["median latency / chunk interval (1 s)", f"{r['latency_per_chunk_interval']:.3f}"],
        ["node process CPU over the stream", f"{r['node_cpu_cores']:.2f} cores"],
        ["chunk tokens (median); chunks that evicted", f"{r['chunk_tokens']:.0f}; "
         f"{r['evicting_chunks']}"],
        ["KV tokens at the end / budget", f"{r['kv_tokens_end']} / {budget}"],
    ]
    if "dashboard_cpu_cores" in r:
        events = r["page_events"]
        table += [
            ["dashboard process CPU over the stream", f"{r['dashboard_cpu_cores']:.2f} cores"],
            ["the page's events: chunk / image / health; images fetched",
             f"{events.get('chunk', 0)} / {events.get('image', 0)} / "
             f"{events.get('health', 0)}; {r['page_images_fetched']}"],
        ]
    return table


def side_by_side(alone: dict[str, Any], attached: dict[str, Any], budget: int) -> str:
    """The two runs of --dashboard in one table, and the ratios that are the claim."""
    values = [value for _, value in rows(alone, budget)]
    table = [[label, values[i] if i < len(values) else "-", value]
             for i, (label, value) in enumerate(rows(attached, budget))]
    ratio = attached["processing_ms"]["median"] / alone["processing_ms"]["median"]
    cpu = attached["node_cpu_cores"] / alone["node_cpu_cores"]
    return md_table(["quantity", "node alone", "node + dashboard + one page"], table) + (
        f"\nWith the dashboard attached, the node's median processing per chunk was {ratio:.2f}x "
        f"and its process CPU {cpu:.2f}x those of the node alone (the same stream, one run "
        "after the other in this invocation).\n")


def report(results: dict[str, Any]) -> str:
    if "runs" in results:
        runs = results["runs"]
        table = side_by_side(runs["alone"], runs["dashboard"], results["budget"])
        who = ("Camera, node, this listener and, in the second run, the dashboard and its page "
               "share the machine's cores.")
    else:
        table = md_table(["quantity", "value"], rows(results["run"], results["budget"]))
        who = "Camera, node and this listener share the machine's cores."
    ros = results["ros"]
    return table + (
        f"\nThe tiny random model on this machine's CPU, {results['size'][0]}x"
        f"{results['size'][1]} rgb8 at {results['fps']:g} fps for {results['seconds']:g} s, "
        f"reliable QoS, {ros['rmw']} (transports: {ros['fastdds_builtin_transports']}). {who}\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: a tiny one)")
    add_camera_args(parser)
    parser.add_argument("--budget", type=int, default=1536, help="KV budget M (tokens)")
    parser.add_argument("--window", type=int, default=512, help="recent window (tokens)")
    parser.add_argument("--pixel-budget", type=int, default=320 * 320)
    parser.add_argument("--dashboard", action="store_true",
                        help="run the stream twice: the node alone, then with `deltas-ros "
                             "dashboard` and one page open on it (end_to_end_dashboard.*)")
    args, results = start_ros_run("end_to_end", parser, argv)
    if args.dashboard:
        results["benchmark"] = "end_to_end_dashboard"  # its own files, beside end_to_end's
    results |= {"fps": args.fps, "seconds": args.seconds,
                "size": [args.width, args.height], "budget": args.budget,
                "window": args.window, "pixel_budget": args.pixel_budget}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or make_model(Path(scratch) / "tiny")
        results["model"] = str(args.model or "tiny (make_model, random)")
        log = Path(scratch) / "published.json"
        if args.dashboard:
            results["runs"] = {"alone": run(model_dir, args, log),
                               "dashboard": run(model_dir, args, log, page=True)}
        else:
            results["run"] = run(model_dir, args, log)
    title = (f"End to end: the memory node ({results['model']}, CPU) fed {args.width}x"
             f"{args.height} at {args.fps:g} fps over DDS"
             + (", alone and with the dashboard attached" if args.dashboard else ""))
    return finish(args.out, results, title, report(results))


if __name__ == "__main__":
    main()
