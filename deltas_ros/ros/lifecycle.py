"""The memory node's lifecycle transitions (rclpy.lifecycle), mixed into `node.MemoryNode`.

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
"""

from __future__ import annotations

import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from sensor_msgs.msg import CompressedImage, Image

from ..runtime.session import NOT_ACTIVE, Session
from .camera import CameraSubscription, camera_topic
from .lifecycle_state import lifecycle_state
from .memory_io import PoseInput

FRAME_HISTORY = 60  # camera messages held for the callback: 2 s at 30 fps
SHUTDOWN_S = 3.0  # on SIGINT/SIGTERM, how long the model may finish its current item
# After the shutdown transition the process leaves this much later: the transition's reply to
# the lifecycle manager goes out first.
EXIT_DELAY_S = 0.5
FINALIZED = "finalized: the node was shut down (lifecycle) and is exiting"
SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE


class MemoryLifecycle:
    """What each transition does to the node's session, camera and poses. The node
    (`MemoryNode`) holds what it reads: session, camera, poses, params, `stopping`, failure,
    lingering and the loader thread.

    The lifecycle state itself is rclpy's (`lifecycle_state.lifecycle_state`), read where it is
    needed: active (the session's `node_active`: questions and health), configuring (a model
    load under way, `threads_ended`), shutting down or finalized (`no_session`), and whether
    autostart's configure is still to come (`autostarting`). Two facts stay ours because rclpy's
    machine does not hold them: `stopping` (SIGINT/SIGTERM end the process without a
    transition, and a configure must give up on it) and the session's `ready` (the model is
    loaded and the worker runs: true already before configuring ends, and a fact of a session
    without a node too)."""

    def _autostart(self) -> None:
        """Configure and activate as a lifecycle manager would, in the background, so that the
        services answer "not ready" while the model loads. A refusal stops the node: nobody
        else would drive it."""
        configured = self.trigger_configure() == SUCCESS
        if configured and not self.stopping.is_set():
            self.trigger_activate()
        if self.failure and not self.stopping.is_set():
            rclpy.try_shutdown(context=self.context)

    def lifecycle_active(self) -> bool:
        """Whether the node takes camera frames and questions (the session's `node_active`):
        rclpy's state is active and the process is not ending (SIGINT/SIGTERM stop the node
        without a transition). Executor threads read it."""
        return not self.stopping.is_set() and lifecycle_state(self) == "active"

    # ----------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Validate the parameters, load the model, open the memory; FAILURE with the reason
        (back to unconfigured) if any of it is wrong."""
        self.failure = ""
        try:
            session = Session.configure(self.params)
        except (ValueError, OSError) as error:
            return self._failed(f"cannot start: {error}")
        session.node_active = self.lifecycle_active
        self.session = session  # not ready yet: the services answer "not ready"
        # Said before the load (minutes for real weights): a log that stops here shows where.
        self.get_logger().info(f"loading the model from {self.values['model_path']} "
                               f"(device {self.values['device']}, dtype {self.values['dtype']})")
        try:
            memory, problem = session.open_memory()
        except RuntimeError as error:
            self.session = None
            return self._failed(str(error))
        if problem:
            self.get_logger().error(problem)
        if self.stopping.is_set():
            return FAILURE
        session.attach(memory, self._publish_chunk, self._pose_at)
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
        """Unsubscribe and end the questions taken: rclpy's state has left active (or
        `stopping` is set), so new ones are refused; the one being answered stops at its next
        token (the answer so far, marked cancelled), the waiting ones are refused."""
        session = self.session
        if session is not None and session.worker is not None:
            session.worker.cancel_questions(NOT_ACTIVE)
        for entity in (self.camera, self.poses):
            if entity is not None:
                entity.close()
        self.camera = self.poses = None

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
        """Whether no thread of ours runs model code: the loader, a configure (rclpy's state
        is "configuring" until on_configure has returned), a worker."""
        return not (lifecycle_state(self) == "configuring" or self.loader.is_alive()
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

    def stop(self) -> bool:
        """SIGINT/SIGTERM: as the shutdown transition; whether every thread of ours ended."""
        return self._shut_down()

