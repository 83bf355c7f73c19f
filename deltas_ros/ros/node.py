"""`deltas_memory`: the ROS 2 node, a managed (lifecycle) node. Camera in, DeltaS memory inside,
answers and health out.

The lifecycle transitions are in lifecycle.py (`MemoryLifecycle`).

Wiring only; the state and its rules live in runtime/session.py (no rclpy), the model in
runtime/worker.py:
    camera callback -> Session.take_frame (FrameGate by header stamp) -> MemoryWorker
    services.py (~/ask_memory, ~/reset_memory, ~/save_memory, ~/load_memory) and
        action.py (~/ask) -> Session.ask / Session.operate -> the worker, between chunks
    pose_topic (optional) -> PoseInput; the worker tags each chunk with the pose at its stamp
    MemoryWorker -> Session.chunk_done -> ~/drift (DriftScore, one per chunk), ~/memory_image,
        ~/memory_chunks and ~/memory_markers after every chunk (the markers after every answer
        too); 1 Hz timer -> /diagnostics

executable.py is the executable around it. Threads: a MultiThreadedExecutor runs the timer,
the lifecycle transitions, the memory services and the parameter services in separate callback
groups; the pool (`EXECUTOR_THREADS`) leaves a thread for the timer whatever planners do (when
every thread was blocked, rclpy's executor spun and starved the worker; docs/reliability.md).
The camera subscription has a node and an executor thread of its own (CameraSubscription):
30 frames a second never wait for, or wake, that pool.
"""

from __future__ import annotations

import threading
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNodeMixin
from rclpy.node import Node

from ..core.config import NODE_NAME
from ..core.decode import decode_message
from ..core.results import DriftRecord, HeldChunk
from ..msg import DriftScore
from ..runtime import params
from ..runtime.health import Level, loading_health
from ..runtime.session import NOT_CONFIGURED, NOT_READY, Session
from .action import ACTION_SLOTS, AskActionServer
from .camera import CameraSubscription
from .camera_frames import deserialize_frame, log_frame_outcome
from .cdr import raw_header, raw_stamp
from .lifecycle import FINALIZED, SHUTDOWN_S, MemoryLifecycle
from .lifecycle_state import RefusedTransitions, lifecycle_state
from .memory_io import MemoryView, PoseInput, pose_stamped
from .messages import diagnostics_message, drift_message
from .parameters import declare_parameters
from .services import QUESTION_SLOTS, MemoryServices

__all__ = ["EXECUTOR_THREADS", "FINALIZED", "NOT_READY", "QUESTION_SLOTS", "SHUTDOWN_S",
           "MemoryNode"]

# Camera, diagnostics, lifecycle, memory services, parameter services, the question slots, the
# action's goals, and a spare.
EXECUTOR_THREADS = QUESTION_SLOTS + ACTION_SLOTS + 6


class MemoryNode(MemoryLifecycle, RefusedTransitions, LifecycleNodeMixin, Node):
    """The DeltaS memory as a managed ROS 2 node (see the module docstring). rclpy's
    LifecycleNode, but with the transitions in their own callback group: a configure that loads
    a model for minutes must not hold up the parameter services."""

    def __init__(self, **kwargs: Any) -> None:
        self.session: Session | None = None  # None while unconfigured
        self.camera: CameraSubscription | None = None  # while active
        self.poses: PoseInput | None = None  # while active, with pose_topic
        self.stopping = threading.Event()  # SIGINT/SIGTERM or shutdown: the process is ending
        self.failure = ""  # why the last transition failed (autostart: exit code 1)
        self.requests_failed, self._failures_lock = 0, threading.Lock()
        # Workers that did not end within SHUTDOWN_S of a cleanup: leaving the interpreter
        # while one runs inside torch aborts, so `main` checks them (threads_ended).
        self.lingering: list = []
        # Before Node.__init__: a refused parameter destroys the half-made node, which stops it.
        # Started (with autostart) before the executor can run a callback: see `autostarting`.
        self.loader = threading.Thread(target=self._autostart, name="deltas_memory_autostart",
                                       daemon=True)
        Node.__init__(self, NODE_NAME, **kwargs)
        LifecycleNodeMixin.__init__(self, callback_group=MutuallyExclusiveCallbackGroup())
        # The one copy of the parameters: the session reads this object too.
        self.params = params.Parameters(params.resolved(declare_parameters(self)))
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.drift_pub = self.create_publisher(DriftScore, "~/drift", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.memory_view = MemoryView(self, self.values["memory_image_thumbnails"])
        self.memory_services = MemoryServices(self)
        self.ask_action = AskActionServer(self)
        # Steady time: health must be reported even when a replayed /clock stops.
        self.create_timer(1.0, self._on_timer, callback_group=MutuallyExclusiveCallbackGroup(),
                          clock=Clock(clock_type=ClockType.STEADY_TIME))
        if self.values["autostart"]:
            self.loader.start()

    @property
    def values(self) -> dict[str, Any]:
        """The current parameter values (one dict, replaced whole on a change)."""
        return self.params.values

    def _log(self):
        """The node's logger; once a signal has shut the context down, a logger of no node,
        which writes to the console only (the node's would fail to publish to /rosout)."""
        if self.context.ok():
            return self.get_logger()
        return rclpy.logging.get_logger(f"{self.get_logger().name}.shutdown")

    def autostarting(self) -> bool:
        """Whether autostart's configure is still to begin or under way, from rclpy's state:
        the loader runs, the state is unconfigured or configuring, and no transition failed nor
        is the process ending. A request then hears "not ready", not "configure it" (the
        services exist from the node's first instant). The loader starts in __init__, before
        the executor runs any callback, so no request sees it not yet started. Left over: a
        manager that cleans the node up in the instant between autostart's configure and its
        activate hears "not ready" until that activate is refused (microseconds)."""
        return (self.loader.is_alive() and not self.failure and not self.stopping.is_set()
                and lifecycle_state(self) in ("unconfigured", "configuring"))

    def no_session(self) -> str:
        """Why a request finds no session: the node is shutting down or finalized (exiting),
        autostart has not got to it yet (the model is about to load), or the node is
        unconfigured."""
        if lifecycle_state(self) in ("shuttingdown", "finalized"):
            return FINALIZED
        return NOT_READY if self.autostarting() else NOT_CONFIGURED

    def request_failed(self, name: str, error: Exception) -> str:
        """A callback of `name` raised `error`: counted, logged; the reply's message."""
        with self._failures_lock:
            self.requests_failed += 1
        message = f"{name} failed inside the node: {type(error).__name__}: {error}"
        self.get_logger().error(message)
        return message

    # ----------------------------------------------------------------------------- wiring
    def _on_set_parameters(self, changes) -> SetParametersResult:
        try:
            proposed = dict(self.values) | {c.name: c.value for c in changes}
            if problem := params.validate(proposed):
                return SetParametersResult(successful=False, reason=problem)
        except Exception as error:  # refused, not raised into the parameter service
            return SetParametersResult(successful=False,
                                       reason=self.request_failed("set_parameters", error))
        self.params.values = proposed
        return SetParametersResult(successful=True)

    def _on_frame(self, raw: bytes) -> None:
        """Every camera frame, serialized: its stamp is read from the bytes and only a sampled
        frame is deserialized and decoded. Nothing in a frame may stop the executor: anything
        unexpected is logged and counted."""
        session, msg_type = self.session, self.camera.msg_type
        try:
            outcome, dropped = session.take_frame(
                raw_stamp(raw), lambda: decode_message(deserialize_frame(raw, msg_type)),
                raw_header(raw)[2])
        except Exception as error:  # a defect must not take the node down with it
            session.note_callback_error()
            self.get_logger().error(f"camera callback failed: {type(error).__name__}: {error}",
                                    throttle_duration_sec=5.0)
            return
        log_frame_outcome(self.get_logger(), outcome, dropped, self.values["max_gap_s"])

    def _pose_at(self, stamp: float):
        poses = self.poses
        return poses.at(stamp) if poses is not None else None

    def _publish_chunk(self, chunk, result, held: list[HeldChunk]) -> None:
        """Worker thread, after the session recorded the chunk: its drift, and what the memory
        holds (`held`, oldest first; the second tier from the session's stats taken with them)
        as the memory image, ~/memory_chunks and the markers."""
        msg = drift_message(DriftRecord.from_result(chunk, result), self.session.frame_id)
        msg.pose = pose_stamped(result.pose, result.stamp)
        self.drift_pub.publish(msg)  # after Ctrl-C this raises; the worker counts it and goes on
        self.memory_view.chunk_done(result, chunk.frames[-1], held, msg.header.frame_id,
                                    self.session.stats.tiered)

    def _on_timer(self) -> None:
        """The 1 Hz report (and the camera's QoS following); a failure is logged, never raised
        into the executor."""
        try:
            self._report()
        except Exception as error:
            self.request_failed("diagnostics", error)

    def _report(self) -> None:
        session, autostarting = self.session, self.autostarting()
        # rclpy's own state (autostart's configure is about to begin: configuring already)
        lifecycle = "configuring" if autostarting else lifecycle_state(self)
        if session is None and autostarting:
            level, message, values = loading_health(self.values)
        elif session is None:
            level, message, values = Level.WARN, f"{lifecycle} (lifecycle)", {}
        else:
            level, message, values = session.health()
        device = str(session.memory.device) if session and session.ready \
            else self.values["device"]
        # Publishers our camera subscription has matched (0: frames cannot arrive yet).
        camera_publishers = 0 if self.camera is None \
            else self.camera.subscription.get_publisher_count()
        self.diag_pub.publish(diagnostics_message(
            self.get_clock().now().to_msg(), f"{self.get_name()}: video memory", level, message,
            device, {"lifecycle": lifecycle, "camera_publishers": camera_publishers,
                     "requests_failed": self.requests_failed, **values}))
        if self.camera is not None:
            self.camera.follow(self.values["silence_warn_s"],
                               max(session.counters.last_frame_wall,
                                   session.counters.started_wall))

    def destroy_node(self) -> None:
        self.stop()
        super().destroy_node()
