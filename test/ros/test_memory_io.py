"""ros_memory's message side without a ROS graph: pose_of for every pose_type a robot can feed
(nav_msgs/Odometry from odometry, PoseWithCovarianceStamped from amcl, PoseStamped), and the
evidence arrays of an answer, which always have equal lengths (zeros where unknown)."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from builtin_interfaces.msg import Time
from deltas_ros.action import AskMemory as AskAction
from deltas_ros.msg import MemoryChunks
from deltas_ros.srv import AskMemory
from geometry_msgs.msg import PoseStamped, PoseWithCovarianceStamped
from nav_msgs.msg import Odometry

from deltas_ros.core.poses import Pose, PoseBuffer
from deltas_ros.core.results import Answer, HeldChunk, TieredChunk
from deltas_ros.core.slot_table import SlotTable
from deltas_ros.ros import memory_io as ros_memory
from deltas_ros.ros.memory_io import POSE_TYPES, PoseInput, fill_answer, pose_of
from deltas_ros.ros.messages import to_time_msg

STAMP = 1_700_000_000.25


def pose_message(kind: str, stamp: float, frame: str, position: tuple[float, float, float],
                 orientation: tuple[float, float, float, float]):
    """A message of pose_type `kind` with the pose where that type keeps it, and decoys where
    a wrong branch would read (Odometry's twist and child frame, the covariance)."""
    msg = POSE_TYPES[kind]()
    msg.header.stamp, msg.header.frame_id = to_time_msg(stamp), frame
    pose = msg.pose if kind == "pose_stamped" else msg.pose.pose
    pose.position.x, pose.position.y, pose.position.z = position
    pose.orientation.x, pose.orientation.y, pose.orientation.z, pose.orientation.w = orientation
    if kind == "odometry":
        msg.child_frame_id = "base_link"
        msg.twist.twist.linear.x, msg.twist.twist.angular.z = 9.0, 9.0
    if kind != "pose_stamped":
        msg.pose.covariance = [0.5] * 36
    return msg


def test_pose_types_are_the_real_message_classes():
    assert POSE_TYPES == {"odometry": Odometry, "pose_stamped": PoseStamped,
                          "pose_with_covariance": PoseWithCovarianceStamped}


@pytest.mark.parametrize("kind", sorted(POSE_TYPES))
def test_pose_of_reads_stamp_frame_and_pose_of_each_type(kind):
    msg = pose_message(kind, STAMP, "odom", (1.5, -2.0, 0.25), (0.0, 0.0, 2.0, 0.0))
    stamp, pose = pose_of(msg)
    assert stamp == pytest.approx(STAMP, abs=1e-6)
    assert pose == Pose("odom", (1.5, -2.0, 0.25), (0.0, 0.0, 1.0, 0.0))  # normalised


@pytest.mark.parametrize("kind", ["odometry", "pose_with_covariance"])
def test_pose_of_refuses_bad_nested_poses(kind):
    """The nested pose (msg.pose.pose) is checked like a PoseStamped's: PoseInput drops it."""
    with pytest.raises(ValueError):
        pose_of(pose_message(kind, STAMP, "map", (0.0, math.nan, 0.0), (0.0, 0.0, 0.0, 1.0)))
    with pytest.raises(ValueError):
        pose_of(pose_message(kind, STAMP, "map", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0)))
    stamp, _ = pose_of(pose_message(kind, 0.0, "map", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0)))
    assert math.isnan(stamp)  # an unset header is no time: the pose buffer refuses it


@pytest.mark.parametrize("kind", ["odometry", "pose_with_covariance"])
def test_a_synthetic_odometry_or_amcl_stream_interpolates(kind):
    """What PoseInput does with each message: pose_of into the buffer, looked up at a stamp."""
    buffer = PoseBuffer(max_gap_s=0.5)
    for i in range(5):  # 10 Hz, 1 m/s along x in "odom"
        buffer.add(*pose_of(pose_message(kind, STAMP + i / 10, "odom", (i / 10, 0.0, 0.0),
                                         (0.0, 0.0, 0.0, 1.0))))
    pose = buffer.at(STAMP + 0.25)
    assert pose.frame_id == "odom" and pose.position == pytest.approx((0.25, 0.0, 0.0))


def slots_with(stamps: list[float | None], poses: list[Pose | None]) -> SlotTable:
    """A slot table holding one two-slot chunk per entry, chunk i at stream time i s."""
    table = SlotTable()
    for chunk, (stamp, pose) in enumerate(zip(stamps, poses)):
        table = table.append(float(chunk), chunk, torch.zeros(2),
                             torch.arange(2 * chunk, 2 * chunk + 2).expand(3, -1),
                             stamp=stamp, pose=pose)
    return table


def answer_of(slots: SlotTable, evidence: list[int]) -> Answer:
    return slots.answer("a red cup", evidence, memory_tokens=len(slots), latency_ms=1.0,
                        generated_tokens=3)


def seconds(stamp: Time) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


@pytest.mark.parametrize("target", [AskMemory.Response, AskAction.Result])
def test_evidence_arrays_have_equal_lengths_with_zeros_where_unknown(target):
    """Every combination of known and unknown stamp and pose, in evidence order: one entry per
    evidence chunk in each array; a zero stamp (0 s, 0 ns) where the stamp is unknown, an empty
    frame_id and the default pose where the pose is unknown."""
    here = Pose("map", (1.0, 2.0, 0.0), (0.0, 0.0, 0.6, 0.8))
    slots = slots_with([STAMP, None, STAMP + 2, None], [here, here, None, None])
    msg = target()
    fill_answer(msg, answer_of(slots, [3, 0, 2, 1]))
    assert msg.answer == "a red cup"
    assert msg.evidence_times == pytest.approx([3.0, 0.0, 2.0, 1.0])
    assert len(msg.evidence_stamps) == len(msg.evidence_poses) == 4
    zero, default = Time(sec=0, nanosec=0), PoseStamped().pose
    assert [msg.evidence_stamps[i] == zero for i in range(4)] == [True, False, False, True]
    assert seconds(msg.evidence_stamps[1]) == pytest.approx(STAMP, abs=1e-6)
    assert seconds(msg.evidence_stamps[2]) == pytest.approx(STAMP + 2, abs=1e-6)
    for stamp, pose in zip(msg.evidence_stamps, msg.evidence_poses):
        assert pose.header.stamp == stamp  # the pose is where the robot was at that stamp
    frames = [pose.header.frame_id for pose in msg.evidence_poses]
    assert frames == ["", "map", "", "map"]
    for i in (0, 2):
        assert msg.evidence_poses[i].pose == default
    assert default.orientation.w == 1.0  # identity, a valid quaternion
    p, q = msg.evidence_poses[1].pose.position, msg.evidence_poses[1].pose.orientation
    assert (p.x, p.y, p.z, q.x, q.y, q.z, q.w) == (1.0, 2.0, 0.0, 0.0, 0.0, 0.6, 0.8)


def test_an_answer_without_poses_still_has_one_pose_per_evidence_chunk():
    """An Answer built without evidence_poses (no pose topic, its dataclass default) still
    fills evidence_poses to the length of the other two arrays; no evidence: all three empty."""
    answer = Answer(text="x", evidence_times=[4.0, 1.0], evidence_stamps=[STAMP, None],
                    memory_tokens=8, span_start=0.0, span_end=4.0, latency_ms=1.0,
                    generated_tokens=1)
    msg = AskMemory.Response()
    fill_answer(msg, answer)
    assert len(msg.evidence_times) == len(msg.evidence_stamps) == len(msg.evidence_poses) == 2
    assert [pose.header.frame_id for pose in msg.evidence_poses] == ["", ""]
    assert msg.evidence_stamps[1] == Time() and msg.evidence_poses[1].header.stamp == Time()
    empty = AskAction.Result()
    fill_answer(empty, answer_of(slots_with([STAMP], [None]), []))
    assert (len(empty.evidence_times), len(empty.evidence_stamps), len(empty.evidence_poses)) \
        == (0, 0, 0)


def test_a_chunk_past_the_newest_pose_waits_for_the_pose_after_it(ros_env, monkeypatch):
    """The pose stream runs on the node's executor and may lag the camera: a chunk past the
    newest pose gets the interpolated pose once the next pose comes (within POSE_WAIT_S), and
    the nearest one, after a bounded wait, when none comes."""
    import rclpy  # here: a module that imports rclpy is marked `ros` as a whole (conftest)

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        node = rclpy.create_node("pose_wait_test", context=context)
        poses = PoseInput(node, "/pose_wait_test", "pose_stamped", 0.5, lambda: None)
        poses.on_pose(pose_message("pose_stamped", 1.0, "map", (1.0, 0.0, 0.0),
                                    (0.0, 0.0, 0.0, 1.0)))
        later = threading.Timer(
            0.05, poses.on_pose, [pose_message("pose_stamped", 1.1, "map", (2.0, 0.0, 0.0),
                                     (0.0, 0.0, 0.0, 1.0))])
        monkeypatch.setattr(ros_memory, "POSE_WAIT_S", 30.0)  # a late timer on a busy machine
        later.start()
        assert poses.at(1.05).position == pytest.approx((1.5, 0.0, 0.0))
        later.join()
        monkeypatch.undo()
        start = time.monotonic()
        assert poses.at(1.3).position == (2.0, 0.0, 0.0)  # none after it: the nearest
        assert time.monotonic() - start < 10.0  # POSE_WAIT_S again, not the 30 s above
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


@pytest.mark.parametrize("target", [AskMemory.Response, AskAction.Result])
def test_the_reasoning_travels_apart_from_the_answer(target):
    answer = Answer(text="red", evidence_times=[], evidence_stamps=[], memory_tokens=8,
                    span_start=0.0, span_end=4.0, latency_ms=1.0, generated_tokens=9,
                    reasoning="the cube on the left is red")
    msg = target()
    fill_answer(msg, answer)
    assert (msg.answer, msg.reasoning) == ("red", "the cube on the left is red")


@pytest.mark.parametrize("target", [AskMemory.Response, AskAction.Result])
def test_what_the_question_recalled_travels_with_the_answer(target):
    answer = Answer(text="red", evidence_times=[], evidence_stamps=[], memory_tokens=8,
                    span_start=0.0, span_end=4.0, latency_ms=1.0, generated_tokens=1,
                    recalled_chunks=3, recalled_from_disk=2, recalled_times=[1.5, 2.0, 7.25])
    msg = target()
    fill_answer(msg, answer)
    assert (msg.recalled_chunks, msg.recalled_from_disk) == (3, 2)
    assert list(msg.recalled_times) == [1.5, 2.0, 7.25]


def test_memory_chunks_list_the_second_tier_beside_the_held_chunks():
    """The tiered chunks come as their own arrays, oldest first, their tier as the message's
    constants; the held chunks' arrays are as without a second tier."""
    held = [HeldChunk(4, 4.0, 10, 0), HeldChunk(5, 5.0, 10, -1)]
    tiered = [TieredChunk(1, 1.0, 12, "disk"), TieredChunk(2, 2.0, 6, "host"),
              TieredChunk(4, 4.0, 4, "host")]
    msg = ros_memory.chunks_message(held, STAMP, "camera", tiered)
    assert (list(msg.stream_time), list(msg.tokens), list(msg.bucket)) == (
        [4.0, 5.0], [10, 10], [0, -1])
    assert list(msg.tiered_time) == [1.0, 2.0, 4.0] and list(msg.tiered_tokens) == [12, 6, 4]
    assert list(msg.tiered_tier) == [MemoryChunks.TIER_DISK, MemoryChunks.TIER_HOST,
                                     MemoryChunks.TIER_HOST]
    alone = ros_memory.chunks_message(held, STAMP, "camera")
    assert not (alone.tiered_time or alone.tiered_tokens or alone.tiered_tier)


def test_the_memory_view_follows_every_chunk_before_any_eviction(ros_env):
    """A memory below its budget evicts nothing, yet a viewer (rqt, the dashboard) sees each new
    chunk on ~/memory_image and ~/memory_chunks; an evicted chunk leaves both, and the second
    tier it went to is listed."""
    import numpy as np
    import rclpy

    from deltas_ros.core.results import ChunkResult
    from deltas_ros.runtime.image import GAP, THUMB_W

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        node = rclpy.create_node("memory_view_test", context=context)
        view = ros_memory.MemoryView(node, 8)
        images, chunks = [], []
        view.image_pub = SimpleNamespace(publish=images.append)
        view.chunks_pub = SimpleNamespace(publish=chunks.append)
        frame = np.full((48, 64, 3), 128, np.uint8)
        held = []
        for index in range(3):
            result = ChunkResult(index, float(index), 0.1, [], 10, 10 * (index + 1), 0,
                                 1.0, 0.1, 0.1, stamp=STAMP + index)
            held.append(HeldChunk(index, float(index), 10, -1))
            view.chunk_done(result, frame, list(held), "camera")
        tiles = [(msg.width - GAP) // (THUMB_W + GAP) for msg in images]
        assert tiles == [1, 2, 3]
        assert [list(msg.stream_time) for msg in chunks] == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0]]
        evicting = ChunkResult(3, 3.0, 0.1, [], 10, 30, 10, 1.0, 0.1, 0.1, stamp=STAMP + 3)
        held = [HeldChunk(0, 0.0, 10, 0), HeldChunk(2, 2.0, 4, 1), HeldChunk(3, 3.0, 10, -1)]
        view.chunk_done(evicting, frame, held, "camera", [TieredChunk(1, 1.0, 10, "host")])
        assert (images[-1].width - GAP) // (THUMB_W + GAP) == 3
        last = chunks[-1]
        assert (list(last.stream_time), list(last.tokens), list(last.bucket)) == (
            [0.0, 2.0, 3.0], [10, 4, 10], [0, 1, -1])
        assert (list(last.tiered_time), list(last.tiered_tokens), list(last.tiered_tier)) == (
            [1.0], [10], [last.TIER_HOST])
        assert not chunks[0].tiered_time  # nothing tiered yet
        assert last.header.frame_id == "camera" and last.header.stamp == to_time_msg(STAMP + 3)
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)
