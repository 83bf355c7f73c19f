"""`deltas_memory`: the ROS 2 node. Camera in, DeltaS memory inside, answers and health out.

A thin adapter over the ROS-free core:
    camera callback -> FrameSampler (by header stamp) -> decode only sampled frames -> MemoryWorker
    ~/ask_memory (AskMemory), ~/reset_memory (std_srvs/Trigger) -> MemoryWorker, between chunks
    MemoryWorker -> ~/drift (DriftScore, one per chunk); 1 Hz timer -> /diagnostics

Threads: a MultiThreadedExecutor runs the camera, the diagnostics timer, the memory services
(reset, save, load) and the parameter services in mutually exclusive callback groups, and the
questions in a group that runs at most `QUESTION_SLOTS` at once. A service callback blocks its
executor thread until the worker has served it, so the pool (`EXECUTOR_THREADS`) is sized to
leave a free thread for the camera and the timer whatever the planners do. (When every pool
thread was blocked, rclpy's executor spun re-submitting the waiting callbacks and starved the
worker of the GIL; see README "Reliability".) Up to `QUESTION_SLOTS` questions wait in the
worker, which answers them back to back before waiting chunks; further requests wait in their
service queue (`SERVICE_QUEUE` deep), in order of arrival.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    SetParametersResult,
)
from rclpy.callback_groups import CallbackGroup, MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header
from std_srvs.srv import Trigger

from . import params
from .frames import (
    FrameGate,
    FrameSampler,
    SampledChunk,
    TimeEvent,
    decode_message,
    message_stamp,
)
from .memory import ChunkResult, StreamingMemory, question_problem
from .model import load_model
from .msg import DriftScore
from .persist import load_memory, save_memory
from .srv import AskMemory, MemoryFile
from .worker import MemoryWorker

ERROR_HOLD_S = 10.0  # diagnostics stay ERROR this long after a failed chunk or question
FRAME_HISTORY = 60  # camera messages held for the callback: 2 s at 30 fps
SERVICE_QUEUE = 100  # requests held per service beyond those being served; more are dropped
QUESTION_SLOTS = 4  # questions handed to the worker at once
# Camera, diagnostics, memory services, parameter services, the question slots, and a spare.
EXECUTOR_THREADS = QUESTION_SLOTS + 5
NOT_READY = "not ready: the model is still loading"


def to_time_msg(seconds: float) -> Time:
    sec = int(seconds // 1)
    return Time(sec=sec, nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))


class BoundedCallbackGroup(CallbackGroup):
    """Callbacks run in parallel, but at most `limit` at once; the rest wait in their queue.

    While the group is full its entities leave the executor's wait set, so nothing spins.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.running = 0
        self._lock = threading.Lock()

    def can_execute(self, entity: Any) -> bool:
        with self._lock:
            return self.running < self.limit

    def beginning_execution(self, entity: Any) -> bool:
        with self._lock:
            if self.running < self.limit:
                self.running += 1
                return True
        return False

    def ending_execution(self, entity: Any) -> None:
        with self._lock:
            self.running -= 1


class MemoryNode(Node):
    """The DeltaS memory as a ROS 2 node (see the module docstring for the data flow)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("deltas_memory", **kwargs)
        self.values = params.resolved(self._declare_parameters())
        problem = params.validate(self.values)
        if problem:
            raise ValueError(problem)
        self.add_on_set_parameters_callback(self._on_set_parameters)

        p = self.values
        if not (Path(p["model_path"]) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {p['model_path']}: config.json is missing")
        self.sampler = FrameSampler(p["fps"], p["frames_per_chunk"], p["max_gap_s"])
        self.gate = FrameGate(self.sampler)
        self.frame_id = ""
        self.callback_errors = 0
        self.chunks_before_ready = 0
        # Counter values at the previous diagnostics report: WARN on what happened since then,
        # not forever after one dropped chunk or bad frame.
        self.frames_at_last_report = 0
        self.drops_at_last_report = 0
        self.bad_at_last_report = 0
        self.last_frame_wall = 0.0
        self.started_wall = time.monotonic()
        self.last_result: ChunkResult | None = None
        self.latencies_ms: list[float] = []
        # Set by the loader thread; `worker` is assigned last and means "ready".
        self.memory: StreamingMemory | None = None
        self.stats = None  # refreshed by the worker after each chunk
        self.worker: MemoryWorker | None = None
        self.load_error = ""
        self.last_chunk: SampledChunk | None = None  # the newest chunk in memory
        self.frame_lock = threading.Lock()  # the sampler between camera and load_memory

        self.drift_pub = self.create_publisher(DriftScore, "~/drift", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        service_qos = QoSProfile(depth=SERVICE_QUEUE, reliability=ReliabilityPolicy.RELIABLE,
                                 durability=DurabilityPolicy.VOLATILE)
        questions, memory_ops = BoundedCallbackGroup(QUESTION_SLOTS), \
            MutuallyExclusiveCallbackGroup()
        for srv_type, name, callback, group in (
            (AskMemory, "~/ask_memory", self._ask, questions),
            (Trigger, "~/reset_memory", self._reset, memory_ops),
            (MemoryFile, "~/save_memory", self._save, memory_ops),
            (MemoryFile, "~/load_memory", self._load, memory_ops),
        ):
            self.create_service(srv_type, name, callback, qos_profile=service_qos,
                                callback_group=group)
        # Steady time: health must be reported even when a replayed /clock stops.
        self.create_timer(1.0, self._publish_diagnostics,
                          callback_group=MutuallyExclusiveCallbackGroup(),
                          clock=Clock(clock_type=ClockType.STEADY_TIME))
        self._subscribe_camera()
        threading.Thread(target=self._load_model, name="deltas_memory_loader",
                         daemon=True).start()

    def _load_model(self) -> None:
        """Load in the background so services answer "not ready" instead of not existing."""
        p = self.values
        try:
            loaded = load_model(p["model_path"], p["device"], p["dtype"])
            memory = StreamingMemory(loaded, params.memory_config(p))
        except Exception as error:  # any failure to load is fatal, with its reason
            self.load_error = f"cannot load the model from {p['model_path']}: {error}"
            self.get_logger().fatal(self.load_error)
            rclpy.try_shutdown(context=self.context)
            return
        if p["load_on_start"] and self._memory_path("").exists():
            try:
                self._restore_from(memory, self._memory_path(""))
            except (ValueError, OSError) as error:
                self.get_logger().error(f"load_on_start: {error}; starting with an empty memory")
        self.memory, self.stats = memory, memory.stats()
        self.worker = MemoryWorker(memory, self._on_chunk_done, p["queue_chunks"])
        self.get_logger().info(
            f"ready: {loaded.path} on {loaded.device} ({str(loaded.dtype)[6:]}, gated delta "
            f"kernels: {'fla' if loaded.fla_kernels else 'torch'}), budget "
            f"{memory.config.budget_tokens} tokens, policy {memory.config.policy}")

    # ----------------------------------------------------------------------------- parameters
    def _declare_parameters(self) -> dict[str, Any]:
        for param in params.PARAMS:
            descriptor = ParameterDescriptor(description=param.description,
                                             read_only=param.read_only)
            if isinstance(param.default, float) and param.low is not None:
                descriptor.floating_point_range = [
                    FloatingPointRange(from_value=param.low, to_value=param.high)]
            elif isinstance(param.default, int) and not isinstance(param.default, bool) \
                    and param.low is not None:
                descriptor.integer_range = [
                    IntegerRange(from_value=int(param.low), to_value=int(param.high))]
            if param.choices:
                descriptor.additional_constraints = "one of: " + ", ".join(param.choices)
            self.declare_parameter(param.name, param.default, descriptor)
        return {p.name: self.get_parameter(p.name).value for p in params.PARAMS}

    def _on_set_parameters(self, changes) -> SetParametersResult:
        proposed = dict(self.values) | {c.name: c.value for c in changes}
        problem = params.validate(proposed)
        if problem:
            return SetParametersResult(successful=False, reason=problem)
        self.values = proposed
        return SetParametersResult(successful=True)

    # ----------------------------------------------------------------------------- camera
    def _subscribe_camera(self) -> None:
        p = self.values
        # A deep history: the callback is cheap, but it shares the interpreter with the model
        # and may be late by a few hundred ms; frames lost here would shift the sampled grid.
        qos = QoSProfile(
            depth=FRAME_HISTORY,
            reliability=ReliabilityPolicy.RELIABLE if p["reliable_qos"]
            else ReliabilityPolicy.BEST_EFFORT,
            durability=DurabilityPolicy.VOLATILE,
        )
        events = SubscriptionEventCallbacks(incompatible_qos=self._on_incompatible_qos)
        msg_type = CompressedImage if p["compressed"] else Image
        self.create_subscription(
            msg_type, p["image_topic"], self._on_frame, qos, event_callbacks=events,
            callback_group=MutuallyExclusiveCallbackGroup(),
        )
        self.get_logger().info(
            f"listening to {self.resolve_topic_name(p['image_topic'])} "
            f"({msg_type.__name__}, {'reliable' if p['reliable_qos'] else 'sensor-data'} QoS)"
        )

    def _on_incompatible_qos(self, event) -> None:
        self.get_logger().error(
            f"camera QoS incompatible with ours (policy {event.last_policy_kind}): no frames "
            "will arrive. A best-effort camera needs reliable_qos:=false (the default); "
            "check durability and reliability of the publisher"
        )

    def _on_frame(self, msg: Image | CompressedImage) -> None:
        """Runs for every camera frame: cheap unless the frame is sampled.

        Nothing a frame contains may stop the executor: anything unexpected is logged and
        counted as a bad frame.
        """
        try:
            self._take_frame(msg)
        except Exception as error:  # a defect must not take the node down with it
            self.callback_errors += 1
            self.get_logger().error(
                f"camera callback failed: {type(error).__name__}: {error}",
                throttle_duration_sec=5.0)

    def _take_frame(self, msg: Image | CompressedImage) -> None:
        self.last_frame_wall = time.monotonic()
        stamp = message_stamp(msg)
        with self.frame_lock:
            outcome = self.gate.push(stamp, lambda: decode_message(msg))
        if outcome.event is TimeEvent.JUMP_BACK:
            self.get_logger().warning(
                f"camera stamps jumped back to {stamp:.3f} (a looped bag or a reset clock): "
                "starting a new stream, the memory is reset")
            if self.worker is not None:
                self.worker.request_reset()
        elif outcome.event is TimeEvent.GAP:
            self.get_logger().warning(
                f"no frames for more than {self.sampler.max_gap_s:.1f} s of stamp time: "
                "new segment, memory kept")
        if outcome.error:
            self.get_logger().warning(f"dropped a camera frame: {outcome.error}",
                                      throttle_duration_sec=5.0)
        if outcome.chunk is None:
            return
        self.frame_id = msg.header.frame_id
        if self.worker is None:
            self.chunks_before_ready += 1
            return
        if self.worker.submit_chunk(outcome.chunk):
            self.get_logger().warning(
                "the model is slower than the stream: dropped the oldest waiting chunk(s) "
                f"({self.worker.counters.chunks_dropped} so far)", throttle_duration_sec=5.0)

    def _on_chunk_done(self, chunk: SampledChunk, result: ChunkResult) -> None:
        """Worker thread: publish the chunk's drift."""
        self.last_result, self.last_chunk = result, chunk
        self.stats = self.memory.stats()
        every = self.values["autosave_chunks"]
        if every and (chunk.index + 1) % every == 0:
            try:
                self._save_to(self.memory, self._memory_path(""))
            except (ValueError, OSError) as error:
                self.get_logger().error(f"autosave failed: {error}", throttle_duration_sec=60.0)
        self.latencies_ms = (self.latencies_ms + [
            result.forward_ms + result.signal_ms + result.evict_ms])[-30:]
        msg = DriftScore()
        msg.header.stamp = to_time_msg(chunk.stamps[-1])
        msg.header.frame_id = self.frame_id
        msg.chunk_index = chunk.index
        msg.stream_time = result.time
        msg.drift = result.drift
        msg.layer_drift = [float(x) for x in result.layer_drift]
        msg.chunk_tokens = result.chunk_tokens
        msg.kv_tokens = result.kv_tokens
        msg.evicted_tokens = result.evicted_tokens
        msg.forward_ms = result.forward_ms
        msg.signal_ms = result.signal_ms
        msg.evict_ms = result.evict_ms
        self.drift_pub.publish(msg)  # after Ctrl-C this raises; the worker counts it and goes on

    # ----------------------------------------------------------------------------- services
    def _ask(self, request: AskMemory.Request, response: AskMemory.Response):
        start = time.perf_counter()
        question = request.question
        if self.worker is None:
            response.error = NOT_READY
        elif problem := question_problem(question, self.values["max_question_chars"],
                                         wire=True):
            response.error = problem
        else:
            try:
                answer = self.worker.ask(question,
                                         request.max_new_tokens or self.values["max_new_tokens"],
                                         self.values["ask_timeout_s"])
            except (RuntimeError, TimeoutError) as error:
                response.error = str(error)
            else:
                response.success = True
                response.answer = answer.text
                response.evidence_times = answer.evidence_times
                response.evidence_stamps = [to_time_msg(s) for s in answer.evidence_stamps
                                            if s is not None]
                response.memory_tokens = answer.memory_tokens
                response.memory_span_start = answer.span_start
                response.memory_span_end = answer.span_end
        response.latency_ms = (time.perf_counter() - start) * 1e3
        if not response.success:
            self.get_logger().warning(f"question refused: {response.error}")
        return response

    def _reset(self, _request: Trigger.Request, response: Trigger.Response):
        if self.worker is None:
            response.message = NOT_READY
            return response
        try:
            self.worker.reset(self.values["ask_timeout_s"])
            with self.frame_lock:  # the camera thread uses the sampler too
                self.sampler.reset()
        except (RuntimeError, TimeoutError) as error:
            response.message = str(error)
        else:
            response.success, response.message = True, "memory reset"
        return response

    def _save(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service(request, response, self._save_to, "saved")

    def _load(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service(request, response, self._restore_from, "loaded")

    def _file_service(self, request, response, action, verb: str):
        path = self._memory_path(request.path)
        response.path = str(path)
        if self.worker is None:
            response.message = NOT_READY
            return response
        try:
            self.worker.call(lambda memory: action(memory, path), self.values["ask_timeout_s"])
        except (RuntimeError, TimeoutError) as error:
            response.message = str(error)
        else:
            response.success = True
            response.chunks = self.memory.chunks_seen
            response.message = f"{verb} {response.chunks} chunks ({self.memory.kv_tokens} " \
                "KV tokens)"
        self.get_logger().info(f"{verb if response.success else 'failed'}: {path}: "
                               f"{response.message}")
        return response

    def _memory_path(self, requested: str) -> Path:
        chosen = requested or self.values["memory_file"]
        if chosen:
            return Path(chosen).expanduser()
        ros_home = Path(os.environ.get("ROS_HOME", Path.home() / ".ros"))
        return ros_home / "deltas_ros" / "memory.safetensors"

    def _save_to(self, memory: StreamingMemory, path: Path) -> None:
        """Worker thread. The sampler's place in the stream goes along, so that a restarted
        node continues the same stream times and chunk indices."""
        chunk = self.last_chunk
        stream = {} if chunk is None else {
            "stream_start": chunk.stamps[-1] - chunk.times[-1],
            "last_stamp": chunk.stamps[-1],
            "next_chunk_index": chunk.index + 1,
        }
        save_memory(memory, path, extra={"stream": stream})

    def _restore_from(self, memory: StreamingMemory, path: Path) -> None:
        stream = load_memory(memory, path).get("extra", {}).get("stream", {})
        with self.frame_lock:
            if not stream:
                self.sampler.reset()
            elif stream["stream_start"] != self.sampler.stream_start:
                # Another stream, or a fresh start: continue the saved one. (Loading a file of
                # the stream that is running keeps the sampler where the camera is.)
                self.sampler.resume(stream["stream_start"], stream["last_stamp"],
                                    stream["next_chunk_index"])
        self.stats = memory.stats()

    # ----------------------------------------------------------------------------- health
    def _publish_diagnostics(self) -> None:
        if self.worker is None:
            self._publish_status(DiagnosticStatus.WARN, "loading the model",
                                 {"model": self.values["model_path"]})
            return
        counters, sampler, result, stats = (self.worker.counters, self.sampler,
                                            self.last_result, self.stats)
        now = time.monotonic()
        frames_per_s = sampler.received - self.frames_at_last_report
        new_drops = counters.chunks_dropped - self.drops_at_last_report
        bad = self.gate.bad_frames + self.callback_errors
        new_bad = bad - self.bad_at_last_report
        self.frames_at_last_report = sampler.received
        self.drops_at_last_report, self.bad_at_last_report = counters.chunks_dropped, bad
        latency = sorted(self.latencies_ms)[len(self.latencies_ms) // 2] \
            if self.latencies_ms else 0.0
        seconds_per_chunk = self.values["frames_per_chunk"] / self.values["fps"]
        level, message = DiagnosticStatus.OK, "ok"
        silent_s = now - (self.last_frame_wall or self.started_wall)
        if counters.last_error and now - counters.last_error_time < ERROR_HOLD_S:
            level, message = DiagnosticStatus.ERROR, counters.last_error
        elif silent_s > self.values["silence_warn_s"]:
            level, message = DiagnosticStatus.WARN, f"no camera frames for {silent_s:.0f} s"
        elif self.worker.queue_depth >= self.values["queue_chunks"] or new_drops:
            level, message = DiagnosticStatus.WARN, "model slower than real time: chunks dropped"
        elif new_bad:
            level, message = DiagnosticStatus.WARN, f"bad frames: {self.gate.last_error}"
        values = {
            "input_rate_hz": f"{frames_per_s:.1f}",
            "frames_received": sampler.received,
            "frames_sampled": sampler.sampled,
            "frames_dropped": sampler.dropped_frames,
            "frames_bad": self.gate.bad_frames,
            "callback_errors": self.callback_errors,
            "time_jumps_back": sampler.time_jumps_back,
            "time_gaps": sampler.time_gaps,
            "chunks_processed": counters.chunks_processed,
            "chunks_dropped": counters.chunks_dropped + self.chunks_before_ready,
            "chunks_failed": counters.chunks_failed,
            "reports_failed": counters.reports_failed,
            "questions_answered": counters.questions_answered,
            "questions_failed": counters.questions_failed,
            "queue_depth": self.worker.queue_depth,
            "questions_waiting": self.worker.questions_waiting,
            "kv_tokens": stats.kv_tokens,
            "budget_tokens": self.memory.config.budget_tokens,
            "memory_bytes": stats.kv_bytes + stats.state_bytes,
            "position": f"{stats.next_position}/{stats.max_positions}",
            "chunk_latency_ms": f"{latency:.1f}",
            "real_time_factor": f"{latency / 1e3 / seconds_per_chunk:.3f}",
            "last_drift": f"{result.drift:.5f}" if result else "",
            "device": str(self.memory.device),
            "model": str(self.memory.loaded.path),
            "policy": self.memory.config.policy,
        }
        self._publish_status(level, message, values)

    def _publish_status(self, level: bytes, message: str, values: dict[str, Any]) -> None:
        device = str(self.memory.device) if self.memory else self.values["device"]
        status = DiagnosticStatus(
            level=level, name=f"{self.get_name()}: video memory", message=message,
            hardware_id=device, values=[KeyValue(key=k, value=str(v)) for k, v in values.items()],
        )
        self.diag_pub.publish(DiagnosticArray(header=Header(stamp=self.get_clock().now().to_msg()),
                                              status=[status]))

    def destroy_node(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        super().destroy_node()


def main(args: list[str] | None = None) -> int:
    rclpy.init(args=args)
    try:
        node = MemoryNode()
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        rclpy.logging.get_logger("deltas_memory").fatal(f"cannot start: {error}")
        rclpy.try_shutdown()
        return 1
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    return 1 if node.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
