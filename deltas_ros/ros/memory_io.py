"""ROS sides of where and what the memory holds: the pose input, ~/memory_image,
~/memory_chunks and ~/memory_markers (markers.py), and an answer's fields as AskMemory's
response and the ask action's result share them."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from builtin_interfaces.msg import Time
from geometry_msgs.msg import PoseStamped, PoseWithCovarianceStamped
from nav_msgs.msg import Odometry
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image

from ..core.decode import message_stamp
from ..core.memory import Answer, ChunkResult
from ..core.poses import Pose, PoseBuffer
from ..core.results import HeldChunk, TieredChunk
from ..msg import MemoryChunks
from ..runtime.image import MemoryImage
from .markers import MemoryMarkers
from .messages import to_time_msg

POSE_TYPES = {"odometry": Odometry, "pose_stamped": PoseStamped,
              "pose_with_covariance": PoseWithCovarianceStamped}
POSE_HISTORY = 2000  # poses kept: 20 s of 100 Hz odometry
POSE_QUEUE = 500  # 5 s of 100 Hz odometry: a busy executor takes them late, not never
# A chunk whose stamp is past the newest pose waits this long (wall) for the pose after it while
# poses flow (one arrived in the last POSE_FLOWING_S): the pose stream, on the node's executor,
# may run a little behind the camera's thread, and the newest pose alone is a stale one.
POSE_WAIT_S = 1.0
POSE_FLOWING_S = 2.0


def pose_of(msg: Odometry | PoseStamped | PoseWithCovarianceStamped) -> tuple[float, Pose]:
    """(header stamp in seconds, pose) of a pose message; ValueError for a bad one."""
    pose = msg.pose.pose if isinstance(msg, (Odometry, PoseWithCovarianceStamped)) else msg.pose
    p, q = pose.position, pose.orientation
    return message_stamp(msg), Pose.checked(msg.header.frame_id, (p.x, p.y, p.z),
                                            (q.x, q.y, q.z, q.w))


def pose_stamped(pose: Pose | None, stamp: float | None) -> PoseStamped:
    """A PoseStamped for a chunk: empty frame_id and the default pose where unknown; a zero
    stamp where the stamp is unknown."""
    msg = PoseStamped()
    if stamp is not None and math.isfinite(stamp):
        msg.header.stamp = to_time_msg(stamp)
    if pose is not None:
        msg.header.frame_id = pose.frame_id
        p, q = msg.pose.position, msg.pose.orientation
        p.x, p.y, p.z = pose.position
        q.x, q.y, q.z, q.w = pose.orientation
    return msg


def fill_answer(target: Any, answer: Answer) -> None:
    """AskMemory.Response / AskMemory action Result fields from an answer. The three evidence
    arrays have one entry per evidence chunk (zero stamps, empty poses where unknown)."""
    target.answer, target.truncated = answer.text, answer.truncated
    target.reasoning = answer.reasoning
    target.evidence_times = [float(t) for t in answer.evidence_times]
    target.evidence_stamps = [Time() if s is None else to_time_msg(s)
                              for s in answer.evidence_stamps]
    poses = answer.evidence_poses or [None] * len(answer.evidence_times)
    target.evidence_poses = [pose_stamped(p, s) for p, s in zip(poses, answer.evidence_stamps)]
    target.memory_tokens = answer.memory_tokens
    target.memory_span_start, target.memory_span_end = answer.span_start, answer.span_end
    target.recalled_chunks = answer.recalled_chunks
    target.recalled_from_disk = answer.recalled_from_disk
    target.recalled_times = [float(t) for t in answer.recalled_times]


class PoseInput:
    """pose_topic into a bounded PoseBuffer; `at` is called from the worker thread.
    A pose message that is not a pose (Pose.checked) is refused, logged and `on_refused()`."""

    def __init__(self, node: Node, topic: str, kind: str, max_gap_s: float,
                 on_refused: Callable[[], None]) -> None:
        self.node, self.lock = node, threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.last_arrival = -math.inf  # time.monotonic() when the newest pose came
        self.buffer = PoseBuffer(POSE_HISTORY, max_gap_s)
        self.on_refused = on_refused
        self.subscription = node.create_subscription(POSE_TYPES[kind], topic, self.on_pose,
                                                     POSE_QUEUE)
        node.get_logger().info(f"poses from {node.resolve_topic_name(topic)} "
                               f"({POSE_TYPES[kind].__name__})")

    def on_pose(self, msg) -> None:
        try:
            stamp, pose = pose_of(msg)
            with self.arrived:
                self.buffer.add(stamp, pose)
                self.last_arrival = time.monotonic()
                self.arrived.notify_all()
        except ValueError as error:  # counted and logged; the buffer is unchanged
            self.on_refused()
            self.node.get_logger().warning(f"dropped a pose: {error}", throttle_duration_sec=5.0)

    def at(self, stamp: float) -> Pose | None:
        """The pose at `stamp` (PoseBuffer.at), after waiting up to POSE_WAIT_S for a pose at or
        after it while poses flow."""
        with self.arrived:
            self.arrived.wait_for(lambda: not self._behind(stamp), POSE_WAIT_S)
            return self.buffer.at(stamp)

    def _behind(self, stamp: float) -> bool:
        """Poses flow, but none has come yet at or after `stamp` (caller holds the lock)."""
        newest = self.buffer.newest()
        return (newest is not None and stamp is not None and newest < stamp
                and time.monotonic() - self.last_arrival < POSE_FLOWING_S)

    def close(self) -> None:
        """Unsubscribe (lifecycle deactivate)."""
        self.node.destroy_subscription(self.subscription)


class MemoryView:
    """What the memory holds, for a person looking: ~/memory_image, the strip of retained
    chunks, ~/memory_chunks, every held chunk with its tokens and bucket and every chunk of the
    second tier with its tier, and ~/memory_markers, where they were seen and the latest
    answer's evidence (all transient local), refreshed after every chunk: a full memory evicts
    on every chunk anyway, so this is the steady state's cost from the first chunk on.
    `chunk_done` runs on the worker thread, `answered` on executor threads."""

    def __init__(self, node: Node, thumbnails: int) -> None:
        qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.image_pub = node.create_publisher(Image, "~/memory_image", qos)
        self.chunks_pub = node.create_publisher(MemoryChunks, "~/memory_chunks", qos)
        self.markers = MemoryMarkers(node, qos)
        self.strip, self.last_index = MemoryImage(thumbnails), -1
        self.logger = node.get_logger()

    def chunk_done(self, result: ChunkResult, frame: np.ndarray, held: list[HeldChunk],
                   frame_id: str, tiered: Sequence[TieredChunk] = ()) -> None:
        if result.index != self.last_index + 1:  # a reset or a load: another memory's chunks
            self.strip = MemoryImage(self.strip.max_thumbnails)
        self.strip.add(result.index, result.time, result.drift, frame)
        self.last_index = result.index
        self.strip.retain(h.index for h in held)
        self.image_pub.publish(image_message(self.strip.render(), result.stamp, frame_id))
        self.chunks_pub.publish(chunks_message(held, result.stamp, frame_id, tiered))
        self.markers.chunks(held)

    def answered(self, answer: Answer) -> None:
        """After a question (service or action): its evidence on ~/memory_markers. A failure
        here is logged, never the caller's: the answer is what the planner waits for."""
        try:
            self.markers.answered(answer)
        except Exception as error:
            self.logger.warning(f"~/memory_markers not refreshed after an answer: "
                                f"{type(error).__name__}: {error}", throttle_duration_sec=5.0)


TIERS = {"host": MemoryChunks.TIER_HOST, "disk": MemoryChunks.TIER_DISK}


def chunks_message(held: list[HeldChunk], stamp: float | None, frame_id: str,
                   tiered: Sequence[TieredChunk] = ()) -> MemoryChunks:
    """A MemoryChunks of the held chunks and the second tier's, each list's arrays in step."""
    msg = MemoryChunks(stream_time=[h.time for h in held], tokens=[h.tokens for h in held],
                       bucket=[h.bucket for h in held],
                       tiered_time=[float(t.time) for t in tiered],
                       tiered_tokens=[t.tokens for t in tiered],
                       tiered_tier=[TIERS[t.tier] for t in tiered])
    if stamp is not None and math.isfinite(stamp):
        msg.header.stamp = to_time_msg(stamp)
    msg.header.frame_id = frame_id
    return msg


def image_message(rgb: np.ndarray, stamp: float | None, frame_id: str) -> Image:
    """An rgb8 sensor_msgs/Image of an (H, W, 3) uint8 array."""
    msg = Image(height=rgb.shape[0], width=rgb.shape[1], encoding="rgb8", is_bigendian=0,
                step=rgb.shape[1] * 3, data=np.ascontiguousarray(rgb).tobytes())
    if stamp is not None and math.isfinite(stamp):
        msg.header.stamp = to_time_msg(stamp)
    msg.header.frame_id = frame_id
    return msg
