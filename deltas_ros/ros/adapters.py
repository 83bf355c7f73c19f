"""The node's ROS plumbing that is not wiring: message builders, parameter declaration, a
callback group that bounds how many service callbacks run at once, a guard that turns any
exception of a service callback into a failed reply, and the camera subscription whose QoS
follows the camera, on an executor of its own."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.callback_groups import CallbackGroup
from rclpy.exceptions import InvalidParameterTypeException, ParameterException

try:
    from rclpy.event_handler import SubscriptionEventCallbacks
except ImportError:  # Humble's rclpy names the module qos_event
    from rclpy.qos_event import SubscriptionEventCallbacks
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.node import Node
from rclpy.qos import (
    DurabilityPolicy,
    HistoryPolicy,
    QoSPolicyKind,
    QoSProfile,
    ReliabilityPolicy,
)
from rclpy.serialization import deserialize_message
from std_msgs.msg import Header

from ..core.decode import FrameError
from ..core.frames import GateOutcome, TimeEvent
from ..core.results import ChunkRecord
from ..msg import DriftScore
from ..runtime import params

CAMERA_SPIN_S = 0.1  # the camera thread's wait per spin: how soon it sees a stop
HISTORIES = {"keep_last": HistoryPolicy.KEEP_LAST, "keep_all": HistoryPolicy.KEEP_ALL}


def to_time_msg(seconds: float) -> Time:
    sec = int(seconds // 1)
    return Time(sec=sec, nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))


class BoundedCallbackGroup(CallbackGroup):
    """Callbacks run in parallel, but at most `limit` at once; the rest wait in their queue.

    While the group is full its entities leave the executor's wait set, so nothing spins.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.running, self._lock = limit, 0, threading.Lock()

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


def deserialize_frame(raw: bytes, msg_type: type) -> Any:
    """A camera message from its CDR bytes; FrameError saying so for bytes that are not one
    (rclpy's own error reads "failed to deserialize ROS message: error not set")."""
    try:
        return deserialize_message(raw, msg_type)
    except Exception as error:  # rclpy raises RMWError / RuntimeError kinds
        raise FrameError(f"malformed {msg_type.__name__} message ({len(raw)} bytes): it cannot "
                         f"be deserialized ({type(error).__name__})") from None


def replying(name: str, callback: Callable[[Any, Any], Any],
             failed: Callable[[str, Exception], str]) -> Callable[[Any, Any], Any]:
    """Service callback(request, response) whose exceptions become a failed reply: success
    false, `message` (and `error` where the type has it) what failed(name, error) says (it
    counts and logs). An exception left to the executor would end the node and its memory."""

    @functools.wraps(callback)
    def guarded(request: Any, response: Any) -> Any:
        try:
            return callback(request, response)
        except Exception as error:  # anything: the node must answer and go on
            response.success = False
            response.message = failed(name, error)
            if hasattr(response, "error"):
                response.error = response.message
            return response

    return guarded


def declare_parameters(node: Node) -> dict[str, Any]:
    """Declare params.PARAMS on `node` with descriptions and ranges; their values.

    ValueError "<parameter>: <reason>" for an override rclpy refuses (a value out of range, of
    another type), instead of rclpy's exception, so the node can say it in one line."""
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
        try:
            node.declare_parameter(param.name, param.default, descriptor)
        except ParameterException as error:
            wrong_type = isinstance(error, InvalidParameterTypeException)
            raise ValueError(f"{param.name}: {params.expectation(param, of_type=wrong_type)}"
                             + (", given another type" if wrong_type else "")) from None
    return {p.name: node.get_parameter(p.name).value for p in params.PARAMS}


def drift_message(record: ChunkRecord, frame_id: str) -> DriftScore:
    """One chunk's DriftScore, field for field its record; its pose (memory_io.pose_stamped)
    is set by the caller."""
    fields = asdict(record)
    msg = DriftScore(**{name: value for name, value in fields.items() if name != "stamp"})
    msg.header.stamp = to_time_msg(record.stamp)
    msg.header.frame_id = frame_id
    return msg


def lifecycle_state(node: Node) -> str:
    """The managed node's current lifecycle state label ("unconfigured", "configuring",
    "inactive", "active", "finalized", ...), as rclpy's state machine holds it: rclpy has no
    public getter, and ~/get_state is a service the node would have to call on itself
    (test_node_lifecycle pins this name). The label is the state being entered while its
    transition callback runs ("configuring" during on_configure, "activating" ...) and the
    goal state once the callback has returned.

    Thread-safe (executor threads, the autostart thread, main at exit): rclpy's binding reads
    the state, and its transitions change it, with the GIL held (src/rclpy/lifecycle.cpp
    releases it in neither); it stays readable after destroy_node."""
    return node._state_machine.current_state[1]


class RefusedTransitions:
    """Mixed in before rclpy's LifecycleNodeMixin: a transition the state machine does not allow
    in the current state (a ChangeState by id, as nav2's manager sends; autostart's configure
    after a manager's) fails with ERROR and a log line. Kilted's rclpy does that itself;
    Jazzy's (7.x) raises RCLError instead, out of the ChangeState service callback, which took
    the node's executor down. Overrides the mixin's private __change_state by its mangled name
    (test_node_lifecycle pins it)."""

    def _LifecycleNodeMixin__change_state(self, transition_id: int) -> TransitionCallbackReturn:
        try:
            return super()._LifecycleNodeMixin__change_state(transition_id)
        except rclpy_implementation.RCLError as error:
            self.get_logger().error(f"lifecycle transition {transition_id} refused in state "
                                    f"{lifecycle_state(self)}: {error}")
            return TransitionCallbackReturn.ERROR


def log_frame_outcome(logger, outcome: GateOutcome, dropped: int, max_gap_s: float) -> None:
    """What the camera callback says about one frame: a time jump taken, a frame dropped,
    chunks dropped for the model being slower than the stream (the last two throttled)."""
    if outcome.event is TimeEvent.JUMP_BACK:
        logger.warning("camera stamps jumped back (a looped bag or a reset clock): starting a "
                       "new stream, the memory is reset")
    elif outcome.event is TimeEvent.GAP:
        logger.warning(f"no frames for more than {max_gap_s:.1f} s of stamp time: new segment, "
                       "memory kept")
    if outcome.error:
        logger.warning(f"dropped a camera frame: {outcome.error}", throttle_duration_sec=5.0)
    if dropped:
        logger.warning("the model is slower than the stream: dropped the oldest waiting "
                       "chunk(s)", throttle_duration_sec=5.0)


def diagnostics_message(stamp: Time, name: str, level: int, message: str, hardware_id: str,
                        values: dict[str, Any]) -> DiagnosticArray:
    status = DiagnosticStatus(level=bytes([level]), name=name, message=message,
                              hardware_id=hardware_id,
                              values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])
    return DiagnosticArray(header=Header(stamp=stamp), status=[status])


def camera_topic(node: Node, compressed: bool, image_topic: str) -> str:
    """The camera topic: the relative name `image` when it is remapped (`-r image:=/cam`; as
    image_transport names it, `<image>/compressed` when compressed, or `image/compressed`
    remapped itself), else the image_topic parameter."""
    def remapped(name: str) -> str | None:
        resolved = node.resolve_topic_name(name)
        return resolved if resolved != node.resolve_topic_name(name, only_expand=True) else None

    if compressed and (topic := remapped("image/compressed")):
        return topic
    if topic := remapped("image"):
        return f"{topic}/compressed" if compressed else topic
    return image_topic


def reliability_override(node: Node, topic: str) -> str | None:
    """The camera subscription's reliability from rclpy's QoS override parameter
    `qos_overrides.<topic>.subscription.reliability` ("reliable" or "best_effort"); None when
    not given (follow the publisher). Declared with an empty default rather than the first
    choice, which would pin it and stop the subscription following the camera. ValueError for
    another value."""
    value = _qos_override(node, topic, "reliability", "", "reliable or best_effort (empty: "
                          "follow the camera's publisher; reliable_qos:=true is an alias of "
                          "reliable)")
    if value not in ("", "reliable", "best_effort"):
        raise ValueError(f"qos_overrides.{topic}.subscription.reliability must be reliable or "
                         f"best_effort, got {value!r}")
    return value or None


def history_override(node: Node, topic: str, depth: int) -> tuple[HistoryPolicy, int]:
    """(history, depth) of the camera subscription from rclpy's QoS override parameters
    `qos_overrides.<topic>.subscription.history` / `.depth` (defaults keep_last, `depth`), as
    QoSOverridingOptions names them; declared on `node`, the memory node, since the
    subscription itself lives on the camera's own node. ValueError for a bad value."""
    history = _qos_override(node, topic, "history", "keep_last", "keep_last or keep_all")
    depth_value = _qos_override(node, topic, "depth", depth, "messages held for the callback")
    if history not in HISTORIES:
        raise ValueError(f"qos_overrides.{topic}.subscription.history must be keep_last or "
                         f"keep_all, got {history!r}")
    if not isinstance(depth_value, int) or depth_value < 1:
        raise ValueError(f"qos_overrides.{topic}.subscription.depth must be an integer >= 1, "
                         f"got {depth_value!r}")
    return HISTORIES[history], depth_value


def _qos_override(node: Node, topic: str, policy: str, default: Any, description: str) -> Any:
    name = f"qos_overrides.{topic}.subscription.{policy}"
    if node.has_parameter(name):  # activated before
        return node.get_parameter(name).value
    descriptor = ParameterDescriptor(read_only=True, description=description)
    return node.declare_parameter(name, default, descriptor).value


class CameraSubscription:
    """The camera subscription (raw: serialized messages), with the camera's reliability unless
    `forced_reliable` or the reliability override parameter (`reliability_override`) says
    otherwise.

    As image_proc does, it subscribes with the publisher's reliability when one exists (all
    reliable: reliable, else best effort); the diagnostics timer calls `follow`, which also
    matches a publisher that appears later, and says once why a matched camera may deliver
    nothing. (A reliable camera's frames of ~0.9 MB and up never arrived over a best-effort
    subscription with Fast DDS's default transports; docs/reliability.md.) A deep history: the
    callback is cheap, but it shares the interpreter with the model and may be late.

    The subscription lives on a node of its own, `<node>_camera` (same namespace, no parameter
    services, no command-line arguments: the memory node resolves the topic and reads the QoS
    overrides), spun by a SingleThreadedExecutor on a thread of its own: on the memory node's
    MultiThreadedExecutor each frame cost ~70 % more process CPU (bench.ingest measures both
    side by side: rgb8/node/raw and rgb8/camera/raw).
    """

    def __init__(self, node: Node, msg_type: type, topic: str, callback: Callable,
                 forced_reliable: bool, depth: int) -> None:
        self.node, self.msg_type, self.callback = node, msg_type, callback
        self.topic = node.resolve_topic_name(topic)
        override = reliability_override(node, self.topic)
        self.history, self.depth = history_override(node, self.topic, depth)
        self.forced = forced_reliable or override is not None
        self.subscription, self.silence_logged = None, False
        self.camera_node = Node(f"{node.get_name()}_camera", namespace=node.get_namespace(),
                                context=node.context, use_global_arguments=False,
                                start_parameter_services=False)
        self._subscribe(forced_reliable or override == "reliable" if self.forced
                        else self.publisher_reliability() is True)
        self.executor = SingleThreadedExecutor(context=node.context)
        self.executor.add_node(self.camera_node)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.spin, name="camera", daemon=True)
        self.thread.start()

    def spin(self) -> None:
        while not self.stopping.is_set():
            try:
                self.executor.spin_once(timeout_sec=CAMERA_SPIN_S)
            except ExternalShutdownException:  # a signal shut the context down during a wait
                return
            except rclpy_implementation.InvalidHandle:
                # The subscription was replaced (`follow` re-subscribes from the memory node's
                # thread) while this wait set was being built: Jazzy's rclpy raises here, and
                # the next wait is built without it.
                continue
            except RuntimeError:  # RCLError: ... before a wait (no wait set on a dead context)
                if self.node.context.ok():
                    raise
                return

    def publisher_reliability(self) -> bool | None:
        """Whether every publisher of the topic is reliable (None: no publisher yet)."""
        found = self.node.get_publishers_info_by_topic(self.topic)
        if not found:
            return None
        return all(i.qos_profile.reliability == ReliabilityPolicy.RELIABLE for i in found)

    def _subscribe(self, reliable: bool) -> None:
        if self.subscription is not None:
            self.camera_node.destroy_subscription(self.subscription)
        qos = QoSProfile(history=self.history, depth=self.depth,
                         durability=DurabilityPolicy.VOLATILE,
                         reliability=ReliabilityPolicy.RELIABLE if reliable
                         else ReliabilityPolicy.BEST_EFFORT)
        # raw: the callback gets the CDR bytes; it reads the stamp from them (cdr.raw_stamp) and
        # deserializes only the frames the sampler keeps.
        self.subscription = self.camera_node.create_subscription(
            self.msg_type, self.topic, self.callback, qos, raw=True,
            event_callbacks=SubscriptionEventCallbacks(incompatible_qos=self._on_incompatible))
        self.reliable, self.silence_logged = reliable, False
        self.since = time.monotonic()
        self.node.get_logger().info(f"listening to {self.topic} ({self.msg_type.__name__}, "
                                    f"{'reliable' if reliable else 'best effort'} QoS)")

    def close(self) -> None:
        """Unsubscribe (lifecycle deactivate): stop the camera thread (no callback runs after
        this returns, unless one is stuck past the join's bound) and destroy its node."""
        self.stopping.set()
        self.thread.join(timeout=5.0)
        self.executor.shutdown(timeout_sec=0.0)
        self.camera_node.destroy_node()

    def follow(self, silence_warn_s: float, last_frame: float) -> None:
        """Resubscribe to match the publishers; log once when matched but silent."""
        if not self.forced:
            wanted = self.publisher_reliability()
            if wanted is not None and wanted != self.reliable:
                self._subscribe(wanted)
                return
        silent_s = time.monotonic() - max(last_frame, self.since)
        if self.subscription.get_publisher_count() and not self.silence_logged \
                and silent_s > silence_warn_s:
            self.silence_logged = True
            self.node.get_logger().warning(self.silence_message(silent_s))

    def silence_message(self, silent_s: float) -> str:
        """Why a matched camera may deliver nothing, and the fix, for our reliability: over
        best effort, large frames (lost by Fast DDS's default transports); over reliable, frames
        would arrive, so the camera publishes nothing (DDS matches only the same message type).
        reliable_qos:=true is not offered for best effort: a best-effort camera cannot match."""
        head = f"a camera publisher is matched on {self.topic} but no frame arrived for " \
            f"{silent_s:.0f} s. "
        if self.reliable:
            return head + ("Likely cause: the camera publishes nothing (reliable QoS delivers "
                           "what is published). Check: ros2 topic hz " + self.topic)
        return head + ("Likely cause: frames of ~0.9 MB and up (640x480 rgb8) over a best-effort "
                       "subscription, which Fast DDS's default transports drop, or a camera that "
                       "publishes nothing. Fix: FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA on both "
                       "sides, or a reliable camera (followed unless the reliability override "
                       "says best_effort)")

    def _on_incompatible(self, event) -> None:
        """DDS refused to match a publisher (it never delivers): say which policy, and the fix
        (only a forced reliable subscription can be incompatible in reliability)."""
        try:
            policy = QoSPolicyKind(int(event.last_policy_kind)).name.lower()
        except (TypeError, ValueError):
            policy = str(event.last_policy_kind)
        ours = "reliable" if self.reliable else "best effort"
        self.node.get_logger().error(
            f"camera QoS incompatible with ours ({ours}) in {policy}: a publisher on "
            f"{self.topic} is not matched, its frames will not arrive. A best-effort camera "
            "cannot feed a reliable subscription: fix: leave reliable_qos false and the "
            "reliability override unset (the node follows the camera), or make the camera "
            "reliable; otherwise check the publisher's durability")
