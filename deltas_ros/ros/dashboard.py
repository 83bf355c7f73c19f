"""`deltas_dashboard`: a live memory dashboard in the browser, as a separate plain node.

It only listens to what the memory node already publishes (~/drift, ~/memory_image,
~/memory_chunks, /diagnostics) and sends goals to its ~/ask action, so it adds no cost to the
memory node, which never imports it. Read-only: no reset, save or load. The HTTP side is
dashboard_http.py (aiohttp on its own thread; this file's callbacks only hand data over).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.action import ActionClient
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image

from ..action import AskMemory
from ..core.config import ASK_TIMEOUT_S, DEFAULT_NODE
from ..msg import DriftScore, MemoryChunks
from .dashboard_access import check_bind, read_token
from .dashboard_body import Question
from .dashboard_http import DashboardHttp
from .dashboard_state import DashboardState
from .plain import pose_dict, seconds

POLL_S = 0.25  # how soon a question notices that its browser left


def chunk_dict(msg: DriftScore) -> dict:
    return {"index": msg.chunk_index, "stream_time": msg.stream_time,
            "stamp": seconds(msg.header.stamp), "drift": msg.drift,
            "chunk_tokens": msg.chunk_tokens, "kv_tokens": msg.kv_tokens,
            "evicted_tokens": msg.evicted_tokens, "pose": pose_dict(msg.pose)}


TIER_NAMES = {MemoryChunks.TIER_HOST: "host", MemoryChunks.TIER_DISK: "disk"}


def held_dict(msg: MemoryChunks) -> dict:
    """The held chunks and the second tier's (`tiered_tier` by name: "host" or "disk");
    `stamp` (the newest chunk's) pairs them with the memory image drawn after the same chunk,
    whose tiles the page then knows chunk by chunk."""
    return {"stream_time": list(msg.stream_time), "tokens": list(msg.tokens),
            "bucket": list(msg.bucket), "stamp": seconds(msg.header.stamp),
            "tiered_time": list(msg.tiered_time), "tiered_tokens": list(msg.tiered_tokens),
            "tiered_tier": [TIER_NAMES.get(t, "") for t in msg.tiered_tier]}


def result_dict(result: Any) -> dict:
    return {"success": result.success, "message": result.message, "answer": result.answer,
            "truncated": result.truncated, "evidence_times": list(result.evidence_times),
            "evidence_stamps": [seconds(s) for s in result.evidence_stamps],
            "evidence_poses": [pose_dict(p) for p in result.evidence_poses],
            "memory_tokens": result.memory_tokens,
            "memory_span": [result.memory_span_start, result.memory_span_end],
            "latency_ms": result.latency_ms, "generated_tokens": result.generated_tokens,
            "recalled_chunks": result.recalled_chunks,
            "recalled_from_disk": result.recalled_from_disk,
            "recalled_times": list(result.recalled_times)}


def jpeg_of(msg: Image) -> bytes:
    """The memory strip as JPEG (cv2 imported here: only the dashboard pays for it);
    ValueError for what the memory node does not publish (not rgb8/bgr8, or data that does not
    fill the header's shape)."""
    import cv2
    import numpy as np

    if msg.encoding not in ("rgb8", "bgr8") or msg.step < msg.width * 3:
        raise ValueError(f"a {msg.encoding} image of step {msg.step} for width {msg.width}")
    rgb = np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.step)
    rgb = rgb[:, :msg.width * 3].reshape(msg.height, msg.width, 3)
    if msg.encoding == "rgb8":
        rgb = rgb[:, :, ::-1]
    ok, data = cv2.imencode(".jpg", rgb)
    return data.tobytes() if ok else b""


class DashboardNode(Node):
    """Subscribes to one memory node's outputs and keeps the bounded DashboardState."""

    def __init__(self, memory_node: str = DEFAULT_NODE,
                 state: DashboardState | None = None) -> None:
        super().__init__("deltas_dashboard")
        # Absolute, whatever this node's own namespace: the launch file passes
        # "<namespace>/deltas_memory", which is relative for a namespace given as "robot1".
        self.memory_node = "/" + memory_node.strip("/")
        self.state = state or DashboardState()
        self.goal_lock = threading.Lock()
        self.goals: list[Any] = []  # goal handles in flight (unhashable)
        self.create_subscription(DriftScore, f"{self.memory_node}/drift",
                                 lambda m: self.state.add_chunk(chunk_dict(m)), 50)
        self.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.create_subscription(Image, f"{self.memory_node}/memory_image",
                                 self._on_image, latched)
        self.create_subscription(MemoryChunks, f"{self.memory_node}/memory_chunks",
                                 lambda m: self.state.set_held(held_dict(m)), latched)
        self.ask_client = ActionClient(self, AskMemory, f"{self.memory_node}/ask")

    def _on_image(self, msg: Image) -> None:
        """The strip re-encoded; one the dashboard cannot read keeps the last one shown."""
        try:
            self.state.set_image(jpeg_of(msg), seconds(msg.header.stamp))
        except ValueError as error:
            self.get_logger().warn(f"memory image not shown: {error}",
                                   throttle_duration_sec=10.0)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        name = self.memory_node.rsplit("/", 1)[-1]
        for status in msg.status:
            if status.name.startswith(f"{name}:"):
                self.state.set_health({"level": int.from_bytes(status.level, "little")
                                       if isinstance(status.level, bytes) else int(status.level),
                                       "message": status.message,
                                       "values": {kv.key: kv.value for kv in status.values}})

    def ask(self, question: Question, on_feedback: Callable[[dict], None],
            left: threading.Event) -> dict:
        """Send one goal and wait for its result, feedback to on_feedback as it comes. When
        `left` is set (the browser went away) the goal is cancelled: nobody waits for its
        answer, and the memory node's worker would spend model time on it before the next
        chunks."""
        if not self.ask_client.wait_for_server(timeout_sec=5.0):
            return {"success": False, "message": "the ask action is not available"}
        done = threading.Event()
        box: dict[str, Any] = {}

        def feedback(msg: Any) -> None:
            f = msg.feedback
            on_feedback({"answer": f.answer, "tokens": f.tokens,
                         "recalled_chunks": f.recalled_chunks,
                         "recalled_from_disk": f.recalled_from_disk})

        def accepted(future: Any) -> None:
            handle = future.result()
            if not handle.accepted:
                box["result"] = {"success": False, "message": "goal rejected"}
                done.set()
                return
            box["handle"] = handle
            with self.goal_lock:
                self.goals.append(handle)
            handle.get_result_async().add_done_callback(
                lambda f: (box.setdefault("result", result_dict(f.result().result)),
                           done.set()))

        goal = AskMemory.Goal(question=question.text, since=question.since,
                              until=question.until)
        self.ask_client.send_goal_async(goal, feedback_callback=feedback) \
            .add_done_callback(accepted)
        deadline = time.monotonic() + ASK_TIMEOUT_S
        while not done.wait(POLL_S):
            if left.is_set() or time.monotonic() > deadline:
                break
        handle = box.get("handle")
        with self.goal_lock:
            if handle in self.goals:
                self.goals.remove(handle)
        if done.is_set():
            return box["result"]
        if handle is not None:
            handle.cancel_goal_async()
        return {"success": False, "message": "the client left" if left.is_set()
                else f"no result within {ASK_TIMEOUT_S:.0f} s"}

    def cancel(self) -> bool:
        """Cancel every goal this dashboard has in flight (the page's Cancel button)."""
        with self.goal_lock:
            goals = list(self.goals)
        for goal in goals:
            goal.cancel_goal_async()
        return bool(goals)


def serve(memory_node: str, host: str, port: int, token: str = "", token_file: str = "",
          allow_hosts: tuple[str, ...] = ()) -> int:
    """Run the dashboard node (rclpy's executor on this thread) and its HTTP server (aiohttp's
    loop on its own) until Ctrl-C."""
    token = read_token(token, token_file)
    check_bind(host, token)
    rclpy.init()
    node = DashboardNode(memory_node)
    server = DashboardHttp(node.state, host, port, token, node.ask, node.cancel, allow_hosts)
    executor = MultiThreadedExecutor(num_threads=4)
    executor.add_node(node)
    try:
        bound = server.start()
    except OSError as error:  # the port is taken, the address is not this machine's, ...
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        raise RuntimeError(f"cannot serve on {host}:{port}: {error.strerror or error}") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"dashboard: http://{shown}:{bound}/" + ("?token=..." if token else ""), flush=True)
    try:
        # Not spin(): after a goal had completed, SIGTERM did not wake its unbounded wait
        # (rclpy 9, seen in test_dashboard.py); a bounded wait sees the context shut down.
        while rclpy.ok():
            executor.spin_once(timeout_sec=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        executor.shutdown()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0
