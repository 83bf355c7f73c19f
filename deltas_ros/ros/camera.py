"""The camera: its topic (remapped or the image_topic parameter) and the subscription whose QoS
follows the camera's publisher, on a node and executor thread of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

try:
    from rclpy.event_handler import SubscriptionEventCallbacks
except ImportError:  # Humble's rclpy names the module qos_event
    from rclpy.qos_event import SubscriptionEventCallbacks
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSPolicyKind, QoSProfile, ReliabilityPolicy

from .camera_qos import history_override, reliability_override

CAMERA_SPIN_S = 0.1  # the camera thread's wait per spin: how soon it sees a stop


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
