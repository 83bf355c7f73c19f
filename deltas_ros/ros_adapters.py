"""The node's ROS plumbing that is not wiring: message builders, parameter declaration, a
callback group that bounds how many service callbacks run at once, and the camera subscription
whose QoS follows the camera."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.callback_groups import CallbackGroup, MutuallyExclusiveCallbackGroup

try:
    from rclpy.event_handler import SubscriptionEventCallbacks
except ImportError:  # Humble's rclpy names the module qos_event
    from rclpy.qos_event import SubscriptionEventCallbacks
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSPolicyKind, QoSProfile, ReliabilityPolicy
from rclpy.qos_overriding_options import QoSOverridingOptions
from std_msgs.msg import Header

from . import params
from .frames import GateOutcome, SampledChunk, TimeEvent
from .memory import ChunkResult
from .msg import DriftScore

HISTORY_AND_DEPTH = (QoSPolicyKind.HISTORY, QoSPolicyKind.DEPTH)


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


def declare_parameters(node: Node) -> dict[str, Any]:
    """Declare params.PARAMS on `node` with descriptions and ranges; their values."""
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
        node.declare_parameter(param.name, param.default, descriptor)
    return {p.name: node.get_parameter(p.name).value for p in params.PARAMS}


def drift_message(chunk: SampledChunk, result: ChunkResult, frame_id: str) -> DriftScore:
    """One chunk's DriftScore; its pose (ros_memory.pose_stamped) is set by the caller."""
    msg = DriftScore(chunk_index=chunk.index, stream_time=result.time, drift=result.drift,
                     layer_drift=[float(x) for x in result.layer_drift],
                     chunk_tokens=result.chunk_tokens, kv_tokens=result.kv_tokens,
                     evicted_tokens=result.evicted_tokens, forward_ms=result.forward_ms,
                     signal_ms=result.signal_ms, evict_ms=result.evict_ms)
    msg.header.stamp = to_time_msg(chunk.stamps[-1])
    msg.header.frame_id = frame_id
    return msg


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
    not given (follow the publisher). Declared here rather than by QoSOverridingOptions, whose
    declared default would pin the first choice and stop the subscription following the camera;
    history and depth go through QoSOverridingOptions. ValueError for another value."""
    name = f"qos_overrides.{topic}.subscription.reliability"
    descriptor = ParameterDescriptor(
        read_only=True, description="reliable or best_effort (empty: follow the camera's "
        "publisher; reliable_qos:=true is an alias of reliable)")
    value = (node.get_parameter(name) if node.has_parameter(name)  # activated before
             else node.declare_parameter(name, "", descriptor)).value
    if value not in ("", "reliable", "best_effort"):
        raise ValueError(f"{name} must be reliable or best_effort, got {value!r}")
    return value or None


class CameraSubscription:
    """The camera subscription (raw: serialized messages), with the camera's reliability unless
    `forced_reliable` or the reliability override parameter (`reliability_override`) says
    otherwise.

    As image_proc does, it subscribes with the publisher's reliability when one exists (all
    reliable: reliable, else best effort); the diagnostics timer calls `follow`, which also
    matches a publisher that appears later, and says once why a matched camera may deliver
    nothing. (A reliable camera's frames of ~0.9 MB and up never arrived over a best-effort
    subscription with Fast DDS's default transports; README "Reliability".) A deep history: the
    callback is cheap, but it shares the interpreter with the model and may be late.
    """

    def __init__(self, node: Node, msg_type: type, topic: str, callback: Callable,
                 forced_reliable: bool, depth: int) -> None:
        self.node, self.msg_type, self.callback, self.depth = node, msg_type, callback, depth
        self.topic = node.resolve_topic_name(topic)
        override = reliability_override(node, self.topic)
        self.forced = forced_reliable or override is not None
        self.group = MutuallyExclusiveCallbackGroup()
        self.subscription, self.silence_logged = None, False
        self._subscribe(forced_reliable or override == "reliable" if self.forced
                        else self.publisher_reliability() is True)

    def publisher_reliability(self) -> bool | None:
        """Whether every publisher of the topic is reliable (None: no publisher yet)."""
        found = self.node.get_publishers_info_by_topic(self.topic)
        if not found:
            return None
        return all(i.qos_profile.reliability == ReliabilityPolicy.RELIABLE for i in found)

    def _subscribe(self, reliable: bool) -> None:
        if self.subscription is not None:
            self.node.destroy_subscription(self.subscription)
        qos = QoSProfile(depth=self.depth, durability=DurabilityPolicy.VOLATILE,
                         reliability=ReliabilityPolicy.RELIABLE if reliable
                         else ReliabilityPolicy.BEST_EFFORT)
        # raw: the callback gets the CDR bytes; it reads the stamp from them (cdr.raw_stamp) and
        # deserializes only the frames the sampler keeps.
        self.subscription = self.node.create_subscription(
            self.msg_type, self.topic, self.callback, qos, callback_group=self.group, raw=True,
            qos_overriding_options=QoSOverridingOptions(HISTORY_AND_DEPTH),
            event_callbacks=SubscriptionEventCallbacks(incompatible_qos=self._on_incompatible))
        self.reliable, self.silence_logged = reliable, False
        self.since = time.monotonic()
        self.node.get_logger().info(f"listening to {self.topic} ({self.msg_type.__name__}, "
                                    f"{'reliable' if reliable else 'best effort'} QoS)")

    def close(self) -> None:
        """Unsubscribe (lifecycle deactivate)."""
        self.node.destroy_subscription(self.subscription)

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
