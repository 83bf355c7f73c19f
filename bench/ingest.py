"""Ingest cost: the node's camera path at 30 fps of 1280x720 frames, raw and JPEG, no model.

Why: the camera callback runs for every frame, 30 times a second, in the process that also runs
the model. Frames that are not sampled (28 of 30 at 2 fps) should cost no more than reading a
stamp; a sampled frame costs a decode; a finished chunk is handed on. The whole ingest path should
take a few percent of one core.

How: a camera process (bench.camera_pub) publishes over DDS; this process subscribes with the
node's camera QoS (reliable, depth FRAME_HISTORY) and its callback runs the node's per-frame path,
FrameGate.push(message_stamp(msg), lambda: decode_message(msg)), plus, for finished chunks,
ChunkBuilder.build (the CPU part of add_chunk; the model itself is left out). Two camera paths:
"deserialize" (the old node: rclpy deserializes every message before the callback) and "raw"
(the node now: a raw subscription, the stamp and frame_id read from the CDR bytes by
deltas_ros.ros.cdr, only sampled frames deserialized), each an input of its own in the same run.
The executor is rclpy's SingleThreadedExecutor ("single"), or a MultiThreadedExecutor with the
node's thread count ("node"), each spun by spin_once in a loop as rclpy's spin() does
("camera" and "events": below). Per frame, over the window from the first to the last callback:
- callback CPU: time.thread_time() around that path, split into non-sampled frames, sampled
  frames (decode) and chunk builds;
- executor thread CPU (single and events only): time.thread_time() from callback to callback, which
  adds rclpy's take and deserialization of the message into Python objects and the executor's own
  work;
- process CPU: time.process_time() from callback to callback, which adds the DDS threads that
  receive and reassemble the message; as a share of one core: process CPU / wall time.
- middleware threads CPU: the part of the process CPU spent on Fast DDS's own threads (named
  dds.*: the shared-memory receive thread that reassembles each frame from its fragments, the
  event thread that acknowledges them), from /proc/self/task/*/schedstat between the first
  callback and the end of the stream. Any subscriber of this camera pays it, whatever its
  callback does; with the callback and one copy of the message (alone_ms) it is the floor that
  no executor or take can go under.
An idle baseline (subscribed, no camera, --idle seconds) and the deserialization of one message
alone (rclpy.serialization, median of 20) are measured too, and the process's minor page faults
per frame (resource.getrusage): each frame is copied three times on its way in (Fast DDS's
reassembly, rmw's serialized take, rclpy's bytes), and a copy onto fresh pages costs more than
the copy itself.

The "events" executor is rclpy's experimental EventsExecutor (C++, no Python wait set per
frame) in place of "single": measured beside the others, not used by the node
(docs/performance.md: an open rclpy bug crashes it when a subscription with event callbacks is
destroyed, which the node's camera subscription does when it follows the camera's QoS).
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import rclpy
from rclpy.executors import Executor, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import CompressedImage, Image

from deltas_ros.core.chunks import ChunkBuilder
from deltas_ros.core.config import DEFAULT_PIXEL_BUDGET
from deltas_ros.core.decode import decode_message, message_stamp
from deltas_ros.core.frames import FrameGate, FrameSampler
from deltas_ros.core.model_maker import make_tokenizer, tiny_config
from deltas_ros.ros.camera import CameraSubscription
from deltas_ros.ros.cdr import raw_header, raw_stamp
from deltas_ros.ros.lifecycle import FRAME_HISTORY
from deltas_ros.ros.node import EXECUTOR_THREADS

from .camera_pub import frame_bank
from .common import (
    add_camera_args,
    finish,
    md_table,
    median,
    percentile,
    start_ros_run,
    stream_camera,
    verdict,
)


def events_executor(context: rclpy.Context) -> Executor:
    """rclpy's experimental EventsExecutor, imported here: rclpy before Kilted has none."""
    from rclpy.experimental import EventsExecutor
    return EventsExecutor(context=context)


TOPICS = {"rgb8": "/bench/camera/image_raw", "jpeg": "/bench/camera/image_raw/compressed"}
EXECUTORS = {
    "single": SingleThreadedExecutor,
    "node": lambda context: MultiThreadedExecutor(num_threads=EXECUTOR_THREADS,
                                                  context=context),  # as node.main
    # The node as it runs: the node's executor spins the node, and the camera subscription is
    # the node's CameraSubscription, on its own node and SingleThreadedExecutor thread.
    "camera": lambda context: MultiThreadedExecutor(num_threads=EXECUTOR_THREADS,
                                                    context=context),
    "events": events_executor,
}
ONE_THREAD = ("single", "events")  # executors that run every callback on the spinning thread
MIDDLEWARE_THREAD = "dds."  # Fast DDS names its threads dds.shm.<port>, dds.ev.<id>, ...
PATHS = ("deserialize", "raw")  # an input name without a path is the deserialize path
DEFAULT_INPUTS = ["rgb8/single", "rgb8/single/raw", "jpeg/single", "jpeg/single/raw",
                  "rgb8/node", "rgb8/node/raw", "rgb8/camera/raw", "rgb8/events/raw"]
TARGETS = {"non_sampled_ms": 0.1, "process_percent": 5.0}


@dataclass
class FrameRecord:
    thread_s: float  # executor thread CPU clock at callback entry
    process_s: float  # process CPU clock at callback entry
    wall_s: float  # perf_counter at callback entry
    page_faults: int  # the process's minor page faults at callback entry
    sampled: bool
    path_s: float  # CPU time of FrameGate.push (stamp, sampling, decode if sampled)
    build_s: float  # CPU time of ChunkBuilder.build, 0 unless the frame finished a chunk


def middleware_cpu_s() -> dict[str, float] | None:
    """CPU seconds so far of each of this process's Fast DDS threads, by thread id (None where
    the kernel keeps no schedstat); threads that already ended are not in it."""
    if not os.path.exists("/proc/self/schedstat"):
        return None
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if not comm.read().startswith(MIDDLEWARE_THREAD):
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as schedstat:
                seconds[tid] = int(schedstat.read().split()[0]) / 1e9  # ns on the CPU
        except OSError:  # the thread ended between listdir and the reads
            continue
    return seconds


def middleware_cpu_between(start: dict[str, float], end: dict[str, float]) -> float:
    """The Fast DDS threads' CPU seconds from one middleware_cpu_s() to a later one, thread by
    thread: a thread that ended in between drops out with its time (its sum once went below
    zero on Jazzy, under load), one that began counts whole."""
    return sum(cpu - start.get(tid, 0.0) for tid, cpu in end.items())


def start_spinning(executor: Executor) -> Callable[[], None]:
    """Spin `executor` on a thread of its own by spin_once in a loop (what rclpy's spin() does,
    and how the camera thread spins; an EventsExecutor's own spin() starved the process's other
    Python threads: no frame arrived); returns what stops it."""
    done = threading.Event()

    def spin_once_loop() -> None:
        while not done.is_set():
            executor.spin_once(timeout_sec=0.1)

    thread = threading.Thread(target=spin_once_loop, daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join(5)  # within one spin_once, so the executor is not shut down under a spin
        executor.shutdown(timeout_sec=5)
    return stop


class Ingest:
    """The node's per-frame path in a subscriber, with CPU clocks around it."""

    def __init__(self, node, encoding: str, raw: bool, subscribe: bool = True) -> None:
        self.gate = FrameGate(FrameSampler())
        config = tiny_config()  # for_model reads only the model's config
        self.builder = ChunkBuilder.for_model(SimpleNamespace(config=config),
                                              make_tokenizer(config.vision_start_token_id),
                                              DEFAULT_PIXEL_BUDGET)
        self.position = 0
        self.records: list[FrameRecord] = []
        self.middleware_s: dict[str, float] | None = None  # middleware_cpu_s(), first callback
        qos = QoSProfile(depth=FRAME_HISTORY, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
        self.msg_type = Image if encoding == "rgb8" else CompressedImage
        if subscribe:
            self.subscription = node.create_subscription(
                self.msg_type, TOPICS[encoding], self.on_raw if raw else self.on_frame, qos,
                raw=raw)

    def on_frame(self, msg: Image | CompressedImage) -> None:
        """The old node's path: rclpy deserialized the message before this call."""
        self.record(lambda: (message_stamp(msg), msg.header.frame_id),
                    lambda: decode_message(msg))

    def on_raw(self, raw: bytes) -> None:
        """The node's path (node._on_frame): stamp and frame_id from the CDR bytes."""
        self.record(lambda: (raw_stamp(raw), raw_header(raw)[2]),
                    lambda: decode_message(deserialize_message(raw, self.msg_type)))

    def record(self, header: Callable[[], tuple[float, str]],
               decode: Callable[[], Any]) -> None:
        if not self.records:  # once, outside the first frame's timings
            self.middleware_s = middleware_cpu_s()
        thread0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        sampled_before = self.gate.sampler.sampled
        stamp, _frame_id = header()
        outcome = self.gate.push(stamp, decode)
        thread1 = time.thread_time()
        for sampled in outcome.chunks:
            chunk = self.builder.build(sampled.frames, sampled.times, self.position)
            self.position = chunk.next_position
        self.records.append(FrameRecord(
            thread0, process0, wall0, faults, self.gate.sampler.sampled > sampled_before,
            thread1 - thread0, time.thread_time() - thread1 if outcome.chunks else 0.0))


def alone_ms(encoding: str, width: int, height: int) -> tuple[float, float]:
    """Medians of 20 on one serialized message, outside the stream: deserializing it, and one
    copy of it into a buffer reused from copy to copy. The copy is the least any subscriber
    pays to take a frame out of the middleware (rmw's serialized take copies it once; rclpy's
    bytes once more, onto fresh pages)."""
    message = frame_bank(encoding, width, height, 1.0, 0)[0]
    raw = serialize_message(message)
    source = np.frombuffer(raw, dtype=np.uint8)
    into = np.empty_like(source)

    def median_ms(operation: Callable[[], Any]) -> float:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            operation()
            times.append((time.perf_counter() - start) * 1e3)
        return median(times)

    return (median_ms(lambda: deserialize_message(raw, type(message))),
            median_ms(lambda: np.copyto(into, source)))


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    encoding, executor_kind, path = (name + "/deserialize").split("/")[:3]
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("bench_ingest", context=context)
    own_thread = executor_kind == "camera"
    ingest = Ingest(node, encoding, raw=path == "raw", subscribe=not own_thread)
    camera = CameraSubscription(node, ingest.msg_type, TOPICS[encoding], ingest.on_raw, True,
                                FRAME_HISTORY) if own_thread else None
    executor: Executor = EXECUTORS[executor_kind](context=context)
    executor.add_node(node)
    stop_spinning = start_spinning(executor)

    def stream_end() -> tuple[int, dict[str, float] | None, float]:
        """Frames so far, the middleware threads' CPU seconds and perf_counter now."""
        return len(ingest.records), middleware_cpu_s(), time.perf_counter()

    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(args.idle)
        idle_percent = 100 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        published = stream_camera(args, TOPICS[encoding], encoding)
        # The camera exits once every frame is acknowledged; callbacks may still be due. A frame
        # that never comes is reported (received < published), not fatal.
        deadline = time.monotonic() + 30.0
        end = stream_end()  # moved to the last frame that comes, not to the deadline
        while len(ingest.records) < published["published"] and time.monotonic() < deadline:
            time.sleep(0.05)
            if len(ingest.records) > end[0]:
                end = stream_end()
    finally:
        if camera is not None:
            camera.close()
        stop_spinning()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return summarize(ingest.records, published, idle_percent,
                     *alone_ms(encoding, args.width, args.height),
                     executor_kind in ONE_THREAD, (ingest.middleware_s, *end[1:]))


def summarize(records: list[FrameRecord], published: dict[str, Any], idle_percent: float,
              deserialize: float, copy: float, one_thread: bool,
              middleware: tuple[dict[str, float] | None, dict[str, float] | None, float],
              ) -> dict[str, Any]:
    """middleware: Fast DDS threads' CPU seconds at the first callback and at the stream's end
    (the publisher's exit, or the last frame that came after it), and perf_counter at the end:
    their share of a core is over that window, which ends within a few tenths of a second of
    the callbacks' window.

    floor: what the process pays per frame whatever its executor and take: the middleware
    threads, the node's own callback and one copy of the message (`alone_ms`)."""
    if len(records) < 2:
        raise RuntimeError(f"only {len(records)} frames arrived of {published['published']}")
    first, last = records[0], records[-1]
    intervals = len(records) - 1
    wall = last.wall_s - first.wall_s
    middleware_start, middleware_end, end_wall = middleware
    middleware_ms = None if middleware_start is None or middleware_end is None else (
        middleware_cpu_between(middleware_start, middleware_end) * 1e3)
    callback_ms = sum((r.path_s + r.build_s) * 1e3 for r in records[:-1]) / intervals
    floor_ms = None if middleware_ms is None else middleware_ms / intervals + callback_ms + copy
    skipped = [r.path_s * 1e3 for r in records if not r.sampled]
    process_ms = (last.process_s - first.process_s) * 1e3
    return {
        "published": published["published"], "received": len(records),
        "message_bytes": published["message_bytes"],
        "sampled": sum(r.sampled for r in records),
        "chunks": sum(r.build_s > 0 for r in records),
        "non_sampled_ms": {"median": median(skipped), "p99": percentile(skipped, 99),
                           "max": max(skipped, default=float("nan"))},
        "sampled_ms": median([r.path_s * 1e3 for r in records if r.sampled]),
        "build_ms": median([r.build_s * 1e3 for r in records if r.build_s > 0]),
        "callback_ms_per_frame": callback_ms,
        "executor_thread_ms_per_frame": (last.thread_s - first.thread_s) * 1e3 / intervals
        if one_thread else None,
        "process_ms_per_frame": process_ms / intervals,
        "process_percent": 100 * process_ms / 1e3 / wall,
        "page_faults_per_frame": (last.page_faults - first.page_faults) / intervals,
        "middleware_ms_per_frame": None if middleware_ms is None else middleware_ms / intervals,
        "middleware_percent": None if middleware_ms is None
        else 100 * middleware_ms / 1e3 / (end_wall - first.wall_s),
        "idle_percent": idle_percent,
        "deserialize_ms": deserialize,
        "copy_ms": copy,
        "floor_ms_per_frame": floor_ms,
        "floor_percent": None if floor_ms is None else 100 * floor_ms * intervals / 1e3 / wall,
        "camera_process_percent": 100 * published["cpu_s"] / published["wall_s"],
    }


def middleware_cell(r: dict[str, Any]) -> str:
    """The middleware threads' column: ms per frame and share of a core."""
    if r["middleware_ms_per_frame"] is None:
        return "n/a (no schedstat)"
    return f"{r['middleware_ms_per_frame']:.3f}, {r['middleware_percent']:.2f} %"


def report(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results["inputs"].items():
        ns = r["non_sampled_ms"]
        thread = r["executor_thread_ms_per_frame"]
        rows.append([
            name, f"{r['received']}/{r['published']}", f"{r['message_bytes'] / 1e6:.2f} MB",
            f"{ns['median'] * 1e3:.1f} / {ns['p99'] * 1e3:.1f} / {ns['max'] * 1e3:.0f}",
            f"{r['sampled_ms']:.2f}", f"{r['build_ms']:.2f}", f"{r['callback_ms_per_frame']:.3f}",
            f"{r['deserialize_ms']:.3f}", "n/a" if thread is None else f"{thread:.3f}",
            f"{r['process_ms_per_frame']:.3f}", f"{r['page_faults_per_frame']:.0f}",
            f"{r['process_percent']:.2f} %", middleware_cell(r),
            f"{r['idle_percent']:.2f} %", f"{r['camera_process_percent']:.1f} %"])
    body = md_table([
        "input / executor", "frames recv/pub", "message", "non-sampled µs (median / p99 / max)",
        "sampled ms (decode)", "chunk build ms", "callback CPU ms/frame",
        "deserialize ms (alone)", "executor thread CPU ms/frame", "process CPU ms/frame",
        "page faults/frame", "process CPU, % of one core",
        "of which middleware threads: ms/frame, % of one core", "idle baseline",
        "camera process (not counted)"], rows)
    checks = []
    for name, r in results["inputs"].items():
        p99 = r["non_sampled_ms"]["p99"]
        checks.append([f"non-sampled frame, {name} (p99)", f"{p99 * 1e3:.1f} µs", "< 100 µs",
                       verdict(p99 < TARGETS["non_sampled_ms"])])
    for name, r in results["inputs"].items():
        checks.append([f"whole ingest path, {name}: process CPU",
                       f"{r['process_percent']:.2f} % of one core", "< 5 %",
                       verdict(r["process_percent"] < TARGETS["process_percent"])
                       if name.startswith("rgb8") else "(target is for raw)"])
    for name, r in results["inputs"].items():
        if r["floor_percent"] is None or not name.startswith("rgb8"):
            continue
        # what the 5 % leaves per frame for the executor and the take (beyond one copy)
        budget_ms = TARGETS["process_percent"] / r["process_percent"] * r["process_ms_per_frame"]
        spare_ms = budget_ms - r["floor_ms_per_frame"]
        checks.append([
            f"floor under it, {name}: middleware threads {r['middleware_ms_per_frame']:.3f}"
            f" + callback {r['callback_ms_per_frame']:.3f} + one copy {r['copy_ms']:.3f}"
            " ms/frame", f"{r['floor_percent']:.2f} % of one core", "< 5 %",
            f"leaves {spare_ms:.3f} ms/frame for the executor and the take" if spare_ms > 0
            else "not reachable by any executor or take"])
    body += "\n" + md_table(["check", "measured", "target", "result"], checks)
    ros = results["ros"]
    body += (f"\nMiddleware: {ros['rmw']}, Fast DDS transports: "
             f"{ros['fastdds_builtin_transports']}; reliable QoS, {results['fps']:g} fps, "
             f"{results['size'][0]}x{results['size'][1]}, {results['seconds']:g} s per input. "
             "Executors: single = rclpy SingleThreadedExecutor, node = the node's "
             f"MultiThreadedExecutor(num_threads={EXECUTOR_THREADS}) running the callback, "
             "camera = the node as it runs: that executor spins the node and the subscription "
             "is the node's CameraSubscription, on its own node and SingleThreadedExecutor "
             "thread; events = rclpy's experimental EventsExecutor in place of single (not "
             "used by the node). Paths: without a "
             "suffix, rclpy takes and deserializes each message before the callback runs "
             "(that cost is in the executor-thread and process columns, not in the callback "
             "column); /raw: a raw subscription, the stamp read from the CDR bytes, only "
             "sampled frames deserialized (inside the callback column).\n")
    return body


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_camera_args(parser, seconds_help="stream length per input")
    parser.add_argument("--idle", type=float, default=3.0, help="idle baseline seconds")
    parser.add_argument("--inputs", nargs="+", default=DEFAULT_INPUTS,
                        choices=[f"{e}/{x}{p}" for e in TOPICS for x in EXECUTORS
                                 for p in ("", "/raw", "/deserialize")
                                 if x != "camera" or p == "/raw"],
                        help="encoding/executor[/path] (path: deserialize, the default, or "
                        "raw), measured one after the other")
    args, results = start_ros_run("ingest", parser, argv)
    results |= {"fps": args.fps, "seconds": args.seconds,
                "size": [args.width, args.height]}
    results["inputs"] = {name: measure(name, args) for name in args.inputs}
    title = (f"Ingest: {args.width}x{args.height} at {args.fps:g} fps over DDS, the node's "
             "per-frame path without the model")
    return finish(args.out, results, title, report(results))


if __name__ == "__main__":
    main()
