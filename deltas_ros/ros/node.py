"""`deltas_memory`: the ROS 2 node, a managed (lifecycle) node. Camera in, DeltaS memory inside,
answers and health out.

Lifecycle (rclpy.lifecycle; with `autostart`, the default, the node walks to active by itself,
else a lifecycle manager drives it through the standard lifecycle_msgs services):
    configure   validate the parameters, load the model, open the memory (load_on_start)
    activate    subscribe to the camera (and pose_topic); questions and ask goals are served
    deactivate  unsubscribe; the memory and its stream are kept; questions are refused
    cleanup     stop the worker, free the model and the memory (RSS / CUDA memory logged)
    shutdown    autosave (when autosave_chunks is set), then free as cleanup does; once
                finalized the process exits (code 0), so a launch file's respawn starts anew
Deactivate, cleanup and shutdown stop a question being answered at its next token and refuse
the waiting ones. Reset, save and load work whenever the node is configured; diagnostics in
every state. Every service, action and parameter callback answers an exception of its own as a
failure (counted in `requests_failed`, logged) instead of leaving it to the executor, which
would end the process and the memory with it.

Wiring only; the state and its rules live in session.py (no rclpy), the model in worker.py:
    camera callback -> Session.take_frame (FrameGate by header stamp) -> MemoryWorker
    memory_services.py (~/ask_memory, ~/reset_memory, ~/save_memory, ~/load_memory) and
        ask_action.py (~/ask) -> MemoryWorker, between chunks
    pose_topic (optional) -> PoseInput; the worker tags each chunk with the pose at its stamp
    MemoryWorker -> ~/drift (DriftScore, one per chunk), ~/memory_image after an eviction;
    1 Hz timer -> /diagnostics

memory_node.py is the executable around it. Threads: a MultiThreadedExecutor runs the timer,
the lifecycle transitions, the memory services and the parameter services in separate callback
groups; the pool (`EXECUTOR_THREADS`) leaves a thread for the timer whatever planners do (when
every thread was blocked, rclpy's executor spun and starved the worker; README "Reliability").
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
from rclpy.lifecycle import LifecycleNodeMixin, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from sensor_msgs.msg import CompressedImage, Image

from ..core.frames import decode_message
from ..msg import DriftScore
from ..runtime import params
from ..runtime.session import NOT_ACTIVE, NOT_CONFIGURED, NOT_READY, Level, Session, loading_health
from .action import ACTION_SLOTS, AskActionServer
from .adapters import (
    CameraSubscription,
    camera_topic,
    declare_parameters,
    deserialize_frame,
    diagnostics_message,
    drift_message,
    log_frame_outcome,
)
from .cdr import raw_header, raw_stamp
from .memory_io import MemoryImageTopic, PoseInput, pose_stamped
from .services import QUESTION_SLOTS, MemoryServices

__all__ = ["EXECUTOR_THREADS", "FINALIZED", "NOT_READY", "QUESTION_SLOTS", "SHUTDOWN_S",
           "MemoryNode"]

FRAME_HISTORY = 60  # camera messages held for the callback: 2 s at 30 fps
# Camera, diagnostics, lifecycle, memory services, parameter services, the question slots, the
# action's goals, and a spare.
EXECUTOR_THREADS = QUESTION_SLOTS + ACTION_SLOTS + 6
SHUTDOWN_S = 3.0  # on SIGINT/SIGTERM, how long the model may finish its current item
# After the shutdown transition the process leaves this much later: the transition's reply to
# the lifecycle manager goes out first.
EXIT_DELAY_S = 0.5
FINALIZED = "finalized: the node was shut down (lifecycle) and is exiting"
SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE


class MemoryNode(LifecycleNodeMixin, Node):
    """The DeltaS memory as a managed ROS 2 node (see the module docstring). rclpy's
    LifecycleNode, but with the transitions in their own callback group: a configure that loads
    a model for minutes must not hold up the parameter services."""

    def __init__(self, **kwargs: Any) -> None:
        self.session: Session | None = None  # None while unconfigured
        self.camera: CameraSubscription | None = None  # while active
        self.poses: PoseInput | None = None  # while active, with pose_topic
        self.stopping, self.configuring = threading.Event(), threading.Event()
        self.failure = ""  # why the last transition failed (autostart: exit code 1)
        self.finalized = False
        self.requests_failed, self._failures_lock = 0, threading.Lock()
        # Workers that did not end within SHUTDOWN_S of a cleanup: leaving the interpreter
        # while one runs inside torch aborts, so `main` checks them (threads_ended).
        self.lingering: list = []
        # Before Node.__init__: a refused parameter destroys the half-made node, which stops it.
        self.loader = threading.Thread(target=self._autostart, name="deltas_memory_autostart",
                                       daemon=True)
        # Set until autostart's configure has a session or gave up: the services exist from
        # then on, and a request in that instant must hear "not ready", not "configure it".
        self.autostarting = threading.Event()
        Node.__init__(self, "deltas_memory", **kwargs)
        LifecycleNodeMixin.__init__(self, callback_group=MutuallyExclusiveCallbackGroup())
        self.values = params.resolved(declare_parameters(self))
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.drift_pub = self.create_publisher(DriftScore, "~/drift", 10)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.memory_image = MemoryImageTopic(self, self.values["memory_image_thumbnails"])
        self.memory_services = MemoryServices(self)
        self.ask_action = AskActionServer(self)
        # Steady time: health must be reported even when a replayed /clock stops.
        self.create_timer(1.0, self._on_timer, callback_group=MutuallyExclusiveCallbackGroup(),
                          clock=Clock(clock_type=ClockType.STEADY_TIME))
        if self.values["autostart"]:
            self.autostarting.set()
            self.loader.start()

    def _autostart(self) -> None:
        """Configure and activate as a lifecycle manager would, in the background, so that the
        services answer "not ready" while the model loads. A refusal stops the node: nobody
        else would drive it."""
        try:
            configured = self.trigger_configure() == SUCCESS
        finally:
            self.autostarting.clear()
        if configured and not self.stopping.is_set():
            self.trigger_activate()
        if self.failure and not self.stopping.is_set():
            rclpy.try_shutdown(context=self.context)

    # ----------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Validate the parameters, load the model, open the memory; FAILURE with the reason
        (back to unconfigured) if any of it is wrong."""
        self.failure = ""
        try:
            session = Session.configure(self.values)
        except (ValueError, OSError) as error:
            return self._failed(f"cannot start: {error}")
        self.configuring.set()
        self.session = session  # not ready yet: the services answer "not ready"
        # Said before the load (minutes for real weights): a log that stops here shows where.
        self.get_logger().info(f"loading the model from {self.values['model_path']} "
                               f"(device {self.values['device']}, dtype {self.values['dtype']})")
        try:
            memory, problem = session.open_memory()
        except RuntimeError as error:
            self.session = None
            return self._failed(str(error))
        finally:
            self.configuring.clear()
        if problem:
            self.get_logger().error(problem)
        if self.stopping.is_set():
            return FAILURE
        session.attach(memory, self._on_chunk_done, self._pose_at)
        loaded = memory.loaded
        self.get_logger().info(
            f"configured: {loaded.path} on {loaded.device} ({str(loaded.dtype)[6:]}, gated "
            f"delta kernels: {'fla' if loaded.fla_kernels else 'torch'}), budget "
            f"{memory.config.budget_tokens} tokens, policy {memory.config.policy}, memory files "
            f"in {session.files.root}")
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Subscribe to the camera (and the poses); serve questions."""
        p = self.values
        try:
            self.camera = CameraSubscription(
                self, CompressedImage if p["compressed"] else Image,
                camera_topic(self, p["compressed"], p["image_topic"]), self._on_frame,
                p["reliable_qos"], FRAME_HISTORY)
        except ValueError as error:  # a bad QoS override parameter
            return self._failed(f"cannot activate: {error}")
        if p["pose_topic"]:
            self.poses = PoseInput(self, p["pose_topic"], p["pose_type"], p["pose_max_gap_s"],
                                   self.session.note_pose_refused)
        self.session.active = True
        self.get_logger().info("active: taking camera frames and questions")
        return SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Stop intake and questions; the memory, its stream clock and waiting chunks stay."""
        self._stop_intake()
        self.get_logger().info("inactive: camera unsubscribed, memory kept")
        return SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_intake()  # questions stop at their next token: the worker can end
        self._free("cleanup")
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Autosave and free; then leave the process (nothing can configure a finalized node)."""
        self._shut_down()
        self.finalized = True
        self._exit_timer = self.create_timer(
            EXIT_DELAY_S, self._exit, callback_group=MutuallyExclusiveCallbackGroup(),
            clock=Clock(clock_type=ClockType.STEADY_TIME))
        return SUCCESS

    def _exit(self) -> None:
        self._exit_timer.cancel()
        self.get_logger().info("finalized: exiting")
        rclpy.try_shutdown(context=self.context)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """A transition raised: drop everything and go back to unconfigured."""
        self.failure = self.failure or f"a lifecycle transition from {state.label} raised"
        self.get_logger().error(self.failure)
        self._stop_intake()
        self._free("error")
        return SUCCESS

    def _stop_intake(self) -> None:
        """Unsubscribe and stop serving questions: the one being answered stops at its next
        token (the answer so far, marked cancelled), the waiting ones are refused."""
        session = self.session
        if session is not None:
            session.active = False
            if session.worker is not None:
                session.worker.cancel_questions(NOT_ACTIVE)
        for entity in (self.camera, self.poses):
            if entity is not None:
                entity.close()
        self.camera = self.poses = None

    def _log(self):
        """The node's logger; once a signal has shut the context down, a logger of no node,
        which writes to the console only (the node's would fail to publish to /rosout)."""
        if self.context.ok():
            return self.get_logger()
        return rclpy.logging.get_logger(f"{self.get_logger().name}.shutdown")

    def no_session(self) -> str:
        """Why a request finds no session: the node is finalized (exiting), autostart has not
        got to it yet (the model is about to load), or the node is unconfigured."""
        if self.finalized:
            return FINALIZED
        return NOT_READY if self.autostarting.is_set() else NOT_CONFIGURED

    def request_failed(self, name: str, error: Exception) -> str:
        """A callback of `name` raised `error`: counted, logged; the reply's message."""
        with self._failures_lock:
            self.requests_failed += 1
        message = f"{name} failed inside the node: {type(error).__name__}: {error}"
        self.get_logger().error(message)
        return message

    def _failed(self, reason: str) -> TransitionCallbackReturn:
        self.failure = reason
        self.get_logger().fatal(reason)
        return FAILURE

    def _free(self, why: str) -> None:
        """Stop the worker and free the model and the memory; a worker still busy after
        SHUTDOWN_S is kept in `lingering`."""
        session, self.session = self.session, None
        if session is None:
            return
        ended, freed = session.close(SHUTDOWN_S)
        if not ended:  # no reference to it before: freeing the memory must not wait for us
            self.lingering.append(session.worker)
            self._log().warning(f"{why}: the model is still inside its current item after "
                                f"{SHUTDOWN_S:.0f} s; it is left to finish")
        self._log().info(f"{why}: the model and the memory are freed ({freed})")

    def threads_ended(self) -> bool:
        """Whether no thread of ours runs model code: the loader, a configure, a worker."""
        return not (self.configuring.is_set() or self.loader.is_alive()
                    or any(worker.alive for worker in self.lingering))

    def _shut_down(self) -> bool:
        """The shutdown transition's work, also on SIGINT/SIGTERM: the autosave when it is set
        (waiting at most SHUTDOWN_S for the worker), then free; whether our threads ended."""
        self.stopping.set()
        self._stop_intake()  # shutdown may come from active
        session = self.session
        if session is not None and session.ready and self.values["autosave_chunks"]:
            try:
                session.worker.call(session.autosave, SHUTDOWN_S, "autosave")
                self._log().info(f"autosaved to {session.files.default}")
            except (RuntimeError, TimeoutError, ValueError, OSError) as error:
                self._log().error(f"autosave at shutdown failed: {error}")
        self._free("shutdown")
        return self.threads_ended()

    # ----------------------------------------------------------------------------- wiring
    def _on_set_parameters(self, changes) -> SetParametersResult:
        try:
            proposed = dict(self.values) | {c.name: c.value for c in changes}
            if problem := params.validate(proposed):
                return SetParametersResult(successful=False, reason=problem)
        except Exception as error:  # refused, not raised into the parameter service
            return SetParametersResult(successful=False,
                                       reason=self.request_failed("set_parameters", error))
        self.values = proposed
        if self.session is not None:
            self.session.values = proposed
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

    def _on_chunk_done(self, chunk, result) -> None:
        """Worker thread: record the chunk, then publish its drift and the memory image."""
        session = self.session
        session.chunk_done(chunk, result)
        msg = drift_message(chunk, result, session.frame_id)
        msg.pose = pose_stamped(result.pose, result.stamp)
        self.drift_pub.publish(msg)  # after Ctrl-C this raises; the worker counts it and goes on
        held = session.memory.slots.retained_chunks()
        self.memory_image.chunk_done(result, chunk.frames[-1], held, msg.header.frame_id)

    def _on_timer(self) -> None:
        """The 1 Hz report (and the camera's QoS following); a failure is logged, never raised
        into the executor."""
        try:
            self._report()
        except Exception as error:
            self.request_failed("diagnostics", error)

    def _report(self) -> None:
        session = self.session
        if session is None and self.autostarting.is_set():
            (level, message, values), lifecycle = loading_health(self.values), "configuring"
        elif session is None:
            lifecycle = "finalized" if self.finalized else "unconfigured"
            level, message, values = Level.WARN, f"{lifecycle} (lifecycle)", {}
        else:
            level, message, values = session.health()
            lifecycle = "configuring" if not session.ready \
                else "active" if session.active else "inactive"
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
                               max(session.last_frame_wall, session.started_wall))

    def stop(self) -> bool:
        """SIGINT/SIGTERM: as the shutdown transition; whether every thread of ours ended."""
        return self._shut_down()

    def destroy_node(self) -> None:
        self.stop()
        super().destroy_node()
