"""`deltas_memory`: the ROS 2 node. Camera in, DeltaS memory inside, answers and health out.

Wiring only; the state and its rules live in session.py (no rclpy), the model in worker.py:
    camera callback -> Session.take_frame (FrameGate by header stamp) -> MemoryWorker
    ~/ask_memory (AskMemory), ~/ask (AskMemory action, ask_action.py), ~/reset_memory (Trigger),
    ~/save_memory, ~/load_memory (MemoryFile) -> MemoryWorker, between chunks; whole-memory
        operations are Session methods run there
    pose_topic (optional) -> PoseInput; the worker tags each chunk with the pose at its stamp
    MemoryWorker -> ~/drift (DriftScore, one per chunk), ~/memory_image after an eviction;
    1 Hz timer -> /diagnostics

Threads: a MultiThreadedExecutor runs the camera, the diagnostics timer, the memory services
(reset, save, load) and the parameter services in mutually exclusive callback groups, and the
questions in a group that runs at most `QUESTION_SLOTS` at once. A service callback blocks its
executor thread until the worker has served it, so the pool (`EXECUTOR_THREADS`) is sized to
leave a free thread for the camera and the timer whatever the planners do. (When every pool
thread was blocked, rclpy's executor spun re-submitting the waiting callbacks and starved the
worker of the GIL; see README "Reliability".) Further requests wait in their service queue
(`SERVICE_QUEUE` deep), in order of arrival.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message
from sensor_msgs.msg import CompressedImage, Image
from std_srvs.srv import Trigger

from . import params
from .ask_action import ACTION_SLOTS, AskActionServer, window
from .cdr import raw_header, raw_stamp
from .frames import TimeEvent, decode_message
from .memory import StreamingMemory
from .memory_files import MemoryFiles, MemoryPathError, read_key
from .model import load_model
from .msg import DriftScore
from .ros_adapters import (
    BoundedCallbackGroup,
    CameraSubscription,
    camera_topic,
    declare_parameters,
    diagnostics_message,
    drift_message,
)
from .ros_memory import MemoryImageTopic, PoseInput, fill_answer, pose_stamped
from .session import NOT_READY, Session, State
from .srv import AskMemory, MemoryFile

FRAME_HISTORY = 60  # camera messages held for the callback: 2 s at 30 fps
SERVICE_QUEUE = 100  # requests held per service beyond those being served; more are dropped
QUESTION_SLOTS = 4  # questions handed to the worker at once
# Camera, diagnostics, memory services, parameter services, the question slots, and a spare.
EXECUTOR_THREADS = QUESTION_SLOTS + ACTION_SLOTS + 5
SHUTDOWN_S = 3.0  # on SIGINT/SIGTERM, how long the model may finish its current item


class MemoryNode(Node):
    """The DeltaS memory as a ROS 2 node (see the module docstring for the data flow)."""

    def __init__(self, **kwargs: Any) -> None:
        self.session: Session | None = None  # first: destroy_node must work if we raise
        self.stopping = threading.Event()
        super().__init__("deltas_memory", **kwargs)
        self.values = params.resolved(declare_parameters(self))
        if problem := params.validate(self.values):
            raise ValueError(problem)
        p = self.values
        if not (Path(p["model_path"]) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {p['model_path']}: config.json is missing")
        files = MemoryFiles(p["memory_dir"], p["memory_file"])
        self.session = Session(p, files, read_key(p["memory_key_file"]))
        self.add_on_set_parameters_callback(self._on_set_parameters)
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
        self.create_timer(1.0, self._on_timer, callback_group=MutuallyExclusiveCallbackGroup(),
                          clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.camera = CameraSubscription(
            self, CompressedImage if p["compressed"] else Image,
            camera_topic(self, p["compressed"], p["image_topic"]),
            self._on_frame, p["reliable_qos"], FRAME_HISTORY)
        self.poses = PoseInput(self, p["pose_topic"], p["pose_type"], p["pose_max_gap_s"]) \
            if p["pose_topic"] else None
        self.memory_image = MemoryImageTopic(self, p["memory_image_thumbnails"])
        self.ask_action = AskActionServer(self, self.session, lambda: self.values)
        self.loader = threading.Thread(target=self._load_model, name="deltas_memory_loader",
                                       daemon=True)
        self.loader.start()

    def _load_model(self) -> None:
        """Load in the background so services answer "not ready" instead of not existing."""
        p, session = self.values, self.session
        try:
            loaded = load_model(p["model_path"], p["device"], p["dtype"])
            memory = StreamingMemory(loaded, params.memory_config(p))
        except Exception as error:  # any failure to load is fatal, with its reason
            session.failed(f"cannot load the model from {p['model_path']}: {error}")
            self.get_logger().fatal(session.load_error)
            rclpy.try_shutdown(context=self.context)
            return
        if p["load_on_start"] and session.files.default.exists():
            try:  # before the worker exists: nothing else touches the memory yet
                session.load(memory, session.files.default)
            except (ValueError, OSError) as error:
                self.get_logger().error(f"load_on_start: {error}; starting with an empty memory")
        if self.stopping.is_set():
            return
        session.attach(memory, self._on_chunk_done, self.poses.at if self.poses else None)
        self.get_logger().info(
            f"ready: {loaded.path} on {loaded.device} ({str(loaded.dtype)[6:]}, gated delta "
            f"kernels: {'fla' if loaded.fla_kernels else 'torch'}), budget "
            f"{memory.config.budget_tokens} tokens, policy {memory.config.policy}, memory files "
            f"in {session.files.root}")

    # ----------------------------------------------------------------------------- parameters
    def _on_set_parameters(self, changes) -> SetParametersResult:
        proposed = dict(self.values) | {c.name: c.value for c in changes}
        if problem := params.validate(proposed):
            return SetParametersResult(successful=False, reason=problem)
        self.values = self.session.values = proposed
        return SetParametersResult(successful=True)

    # ----------------------------------------------------------------------------- camera
    def _on_frame(self, raw: bytes) -> None:
        """Every camera frame, serialized: its stamp is read from the bytes and only a sampled
        frame is deserialized and decoded. Nothing in a frame may stop the executor: anything
        unexpected is logged and counted."""
        try:
            stamp, frame_id = raw_stamp(raw), raw_header(raw)[2]
            outcome, dropped = self.session.take_frame(
                stamp, lambda: decode_message(deserialize_message(raw, self.camera.msg_type)),
                frame_id)
        except Exception as error:  # a defect must not take the node down with it
            self.session.note_callback_error()
            self.get_logger().error(f"camera callback failed: {type(error).__name__}: {error}",
                                    throttle_duration_sec=5.0)
            return
        log = self.get_logger()
        if outcome.event is TimeEvent.JUMP_BACK:
            log.warning("camera stamps jumped back (a looped bag or a reset clock): starting a "
                        "new stream, the memory is reset")
        elif outcome.event is TimeEvent.GAP:
            log.warning(f"no frames for more than {self.values['max_gap_s']:.1f} s of stamp "
                        "time: new segment, memory kept")
        if outcome.error:
            log.warning(f"dropped a camera frame: {outcome.error}", throttle_duration_sec=5.0)
        if dropped:
            log.warning("the model is slower than the stream: dropped the oldest waiting "
                        "chunk(s)", throttle_duration_sec=5.0)

    def _on_chunk_done(self, chunk, result) -> None:
        """Worker thread: record the chunk, then publish its drift."""
        self.session.chunk_done(chunk, result)
        msg = drift_message(chunk, result, self.session.frame_id)
        msg.pose = pose_stamped(result.pose, result.stamp)
        self.drift_pub.publish(msg)  # after Ctrl-C this raises; the worker counts it and goes on
        held = self.session.memory.slots.retained_chunks()
        self.memory_image.chunk_done(result, chunk.frames[-1], held, msg.header.frame_id)

    # ----------------------------------------------------------------------------- services
    def _ask(self, request: AskMemory.Request, response: AskMemory.Response):
        start, session = time.perf_counter(), self.session
        response.error = session.question_refusal(request.question, request.max_new_tokens)
        if not response.error:
            try:
                answer = session.worker.ask(
                    request.question, request.max_new_tokens or self.values["max_new_tokens"],
                    self.values["ask_timeout_s"], **window(request.since, request.until))
            except (RuntimeError, TimeoutError) as error:
                response.error = str(error)
            else:
                response.success = True
                fill_answer(response, answer)
        response.message = response.error  # `error` is the deprecated name of `message`
        response.latency_ms = (time.perf_counter() - start) * 1e3
        if not response.success:
            self.get_logger().warning(f"question refused: {response.error}")
        return response

    def _operation(self, name: str, function) -> tuple[Any, str]:
        """Run a Session operation on the worker: (its OpResult or None, the error)."""
        if not self.session.ready:
            return None, NOT_READY
        try:
            return self.session.worker.call(function, self.values["ask_timeout_s"], name), ""
        except (RuntimeError, TimeoutError) as error:
            return None, str(error)

    def _reset(self, _request: Trigger.Request, response: Trigger.Response):
        result, response.message = self._operation("reset", self.session.reset)
        if result is not None:
            response.success = True
            response.message = f"memory reset ({result.discarded} waiting chunks discarded)"
        return response

    def _save(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service("save", request, response)

    def _load(self, request: MemoryFile.Request, response: MemoryFile.Response):
        return self._file_service("load", request, response)

    def _file_service(self, verb: str, request, response):
        session = self.session
        try:
            path = session.files.resolve(request.path)
        except MemoryPathError as error:
            session.refuse_request()
            response.path, response.message = request.path[:1000], str(error)
        else:
            action = session.save if verb == "save" else session.load
            response.path = str(path)
            result, response.message = self._operation(verb, lambda m: action(m, path))
            if result is not None:
                response.success, response.chunks = True, result.chunks
                response.message = f"{verb}ed {result.chunks} chunks ({result.kv_tokens} KV " \
                    f"tokens; {result.discarded} waiting chunks discarded)"
        self.get_logger().info(f"{verb} {response.path}: {response.message}")
        return response

    # ----------------------------------------------------------------------------- health
    def _on_timer(self) -> None:
        level, message, values = self.session.health()
        device = str(self.session.memory.device) if self.session.ready else self.values["device"]
        self.diag_pub.publish(diagnostics_message(
            self.get_clock().now().to_msg(), f"{self.get_name()}: video memory", level, message,
            device, values))
        self.camera.follow(self.values["silence_warn_s"],
                           max(self.session.last_frame_wall, self.session.started_wall))

    def stop(self) -> bool:
        """Fail waiting requests, give the model SHUTDOWN_S to finish its item; whether every
        thread of ours has ended."""
        self.stopping.set()
        worker = self.session.worker if self.session else None
        ended = worker.stop(SHUTDOWN_S) if worker is not None else True
        return ended and not (hasattr(self, "loader") and self.loader.is_alive())

    def destroy_node(self) -> None:
        self.stop()
        super().destroy_node()


def main(args: list[str] | None = None) -> int:
    rclpy.init(args=args)
    # Before the node: a signal during start-up shuts the context down, after which no executor
    # can be made (it once failed with "the given context is not valid").
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    try:
        node = MemoryNode()
    except KeyboardInterrupt:  # Ctrl-C before the node was up (and before its threads)
        return _close(executor, 0)
    except (ValueError, OSError, RuntimeError) as error:  # RCLError is a RuntimeError
        if not rclpy.ok():  # SIGTERM while constructing: the context is gone, not an error
            return _close(executor, 0)
        rclpy.logging.get_logger("deltas_memory").fatal(f"cannot start: {error}")
        return _close(executor, 1)
    try:
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RuntimeError:  # RCLError: a signal shut the context down inside rclpy's wait
        if rclpy.ok():
            raise
    finally:
        ended = node.stop()  # first: service callbacks waiting for the worker return now
        executor.shutdown(timeout_sec=SHUTDOWN_S)
        node.destroy_node()
        rclpy.try_shutdown()
    code = 1 if node.session.state is State.FAILED else 0
    if not ended:
        # The model is still loading or answering inside torch: leaving the interpreter with
        # that thread running aborts in C++ ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _close(executor: MultiThreadedExecutor, code: int) -> int:
    """Leave before a node existed: the executor and the context, nothing else."""
    executor.shutdown(timeout_sec=0.0)
    rclpy.try_shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
