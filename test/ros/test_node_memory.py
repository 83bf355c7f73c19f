"""The node's ROS-native memory over DDS, from another process: the ask action (feedback as
tokens decode, cancel, memory bit-identical), a time-windowed question, chunk poses from a
synthetic pose stream on DriftScore and as evidence, the ~/memory_image and ~/memory_markers
topics, and goals rejected while the node is not active or its action slots are full."""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from action_msgs.msg import GoalStatus
from deltas_ros.action import AskMemory as AskAction
from deltas_ros.msg import MemoryChunks
from deltas_ros.srv import AskMemory, MemoryFile
from geometry_msgs.msg import PoseStamped
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from ros_helpers import (
    BASE_STAMP,
    SMALL,
    Tester,
    node_command,
    send_goal,
    stamp_msg,
    status_values,
    stop,
    wait_future,
)
from safetensors.torch import load_file
from sensor_msgs.msg import Image
from visualization_msgs.msg import Marker, MarkerArray

from deltas_ros.core.poses import Pose
from deltas_ros.ros.action import ACTION_SLOTS
from deltas_ros.runtime.image import GAP, LABEL_H, THUMB_H, THUMB_W

REPO = Path(__file__).resolve().parents[2]
POSE_LEAD = 3.5 / 30  # poses are published this far ahead of the frames (and between them)


def expected_pose(stamp: float) -> Pose:
    """The synthetic robot: 0.5 m/s along x, 0.2 m/s along y, turning at 0.1 rad/s."""
    t = stamp - BASE_STAMP
    return Pose("map", (0.5 * t, 0.2 * t, 0.0), (0.0, 0.0, math.sin(0.05 * t),
                                                 math.cos(0.05 * t)))


def seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def assert_pose(msg: PoseStamped, stamp: float) -> None:
    want = expected_pose(stamp)
    p, q = msg.pose.position, msg.pose.orientation
    assert msg.header.frame_id == "map"
    assert (p.x, p.y, p.z) == pytest.approx(want.position, abs=1e-6)
    assert (q.x, q.y, q.z, q.w) == pytest.approx(want.orientation, abs=1e-6)


class MemoryTester(Tester):
    """Tester with a pose publisher and a memory image listener (the action client is the
    base Tester's, made before it spins)."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.pose_pub = self.node.create_publisher(PoseStamped, "/robot_pose", 100)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.images: list[Image] = self.collecting(Image, "/deltas_memory/memory_image",
                                                   latched)
        self.held: list[MemoryChunks] = self.collecting(
            MemoryChunks, "/deltas_memory/memory_chunks", latched)
        self.markers: list[MarkerArray] = self.collecting(
            MarkerArray, "/deltas_memory/memory_markers", latched)

    def publish_pose(self, stamp: float) -> None:
        pose = expected_pose(stamp)
        msg = PoseStamped()
        msg.header.stamp, msg.header.frame_id = stamp_msg(stamp), pose.frame_id
        p, q = msg.pose.position, msg.pose.orientation
        p.x, p.y, p.z = pose.position
        q.x, q.y, q.z, q.w = pose.orientation
        self.pose_pub.publish(msg)

    def stream_with_poses(self, seconds_: float, speed: float = 2.0) -> None:
        """Frames at 30 fps; a pose half a frame off each frame, published ahead of it."""
        self.stream(seconds_, speed=speed,
                    on_frame=lambda i: self.publish_pose(BASE_STAMP + i / 30 + POSE_LEAD))

    def goal(self, question: str, max_new_tokens: int, cancel_after: int | None = None,
             timeout: float = 120.0):
        """(status, result, feedback list) of one goal; cancelled after `cancel_after`
        feedback messages when given."""
        feedback: list = []
        handle = send_goal(self.action, AskAction.Goal(question=question,
                                                       max_new_tokens=max_new_tokens),
                           timeout, feedback)
        assert handle.accepted
        result = handle.get_result_async()
        if cancel_after is not None:
            deadline = time.monotonic() + timeout
            while len(feedback) < cancel_after and not result.done():
                assert time.monotonic() < deadline, "no feedback in time"
                time.sleep(0.01)
            wait_future(handle.cancel_goal_async(), timeout)
        response = wait_future(result, timeout)
        return response.status, response.result, feedback


@pytest.fixture(scope="module")
def node(tiny_model_dir, ros_domain):
    # The camera reaches the node only through the remapped relative name `image`. DeltaS
    # drops chunks whole, so the strip and the chunk list lose some chunks entirely.
    command = node_command(tiny_model_dir, "/not/the/camera", **(SMALL | dict(
        reliable_qos="true", pose_topic="/robot_pose", pose_type="pose_stamped",
        policy="deltas")))
    process = subprocess.Popen(command + ["-r", "image:=/camera/image_raw"], env=ros_domain,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tester = MemoryTester()
    try:
        tester.wait_ready(process)
        tester.stream_with_poses(14.0)
        tester.wait_for(lambda: any(m.evicted_tokens for m in tester.drift), timeout=240)
        tester.wait_for_status(lambda s: status_values(s)["queue_depth"] == "0"
                               and not status_values(s)["serving"], timeout=240)
        yield tester, process
    finally:
        tester.close()
        code, err = stop(process)
        print(f"memory_node exited {code}; stderr:\n{err[-5000:]}")


def test_chunks_carry_the_pose_at_their_stamp(node):
    tester, _ = node
    with tester.lock:
        drift = list(tester.drift)
    assert len(drift) >= 5
    for msg in drift:
        assert_pose(msg.pose, seconds(msg.header.stamp))
        assert msg.pose.header.stamp == msg.header.stamp


def test_windowed_question_has_evidence_and_poses_from_its_window(node):
    tester, _ = node
    with tester.lock:
        times = sorted(m.stream_time for m in tester.drift)
    since, until = times[-4] - 0.01, times[-2] + 0.01  # three recent chunks, always retained
    request = AskMemory.Request(question="Where was the red cup?", max_new_tokens=2,
                                since=since, until=until)
    response = tester.call(tester.ask_client, request, timeout=120)
    assert response.success, response.message
    assert response.message == response.error == ""
    assert response.evidence_times and all(since <= t <= until for t in response.evidence_times)
    assert len(response.evidence_stamps) == len(response.evidence_poses) == \
        len(response.evidence_times)
    for stamp, pose in zip(response.evidence_stamps, response.evidence_poses):
        assert pose.header.stamp == stamp
        assert_pose(pose, seconds(stamp))
    empty = tester.call(tester.ask_client, AskMemory.Request(question="Where?", since=1e6),
                        timeout=120)
    assert not empty.success and "no retained chunk" in empty.message
    assert empty.message == empty.error


def saved_tensors(tester: MemoryTester, name: str) -> dict[str, torch.Tensor]:
    client = tester.node.create_client(MemoryFile, "/deltas_memory/save_memory")
    reply = tester.call(client, MemoryFile.Request(path=name), timeout=120)
    assert reply.success, reply.message
    return load_file(reply.path)


def test_action_streams_feedback_honours_cancel_and_leaves_the_memory(node):
    tester, _ = node
    before = saved_tensors(tester, "before_action.safetensors")
    status, result, feedback = tester.goal("What did you see?", max_new_tokens=6)
    assert status == GoalStatus.STATUS_SUCCEEDED and result.success, result.message
    assert [f.tokens for f in feedback] == list(range(1, result.generated_tokens + 1))
    assert feedback and feedback[-1].answer == result.answer
    assert len(result.evidence_poses) == len(result.evidence_times) > 0
    assert result.recalled_chunks == result.recalled_from_disk == 0  # no second tier

    status, cancelled, feedback = tester.goal("What did you see?", max_new_tokens=400,
                                              cancel_after=2)
    assert status == GoalStatus.STATUS_CANCELED and not cancelled.success
    assert 2 <= cancelled.generated_tokens < 400  # stopped within a token of the cancel
    after = saved_tensors(tester, "after_action.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_memory_image_shows_the_retained_chunks(node):
    tester, _ = node
    tester.wait_for(lambda: tester.images, timeout=60)
    with tester.lock:
        image, chunks = tester.images[-1], len(tester.drift)
    assert image.encoding == "rgb8" and image.height == THUMB_H + LABEL_H
    pixels = np.frombuffer(bytes(image.data), np.uint8).reshape(image.height, image.width, 3)
    tiles = (image.width - GAP) // (THUMB_W + GAP)
    assert 2 <= tiles < chunks  # evicted chunks are gone from the strip
    assert pixels[:THUMB_H].std() > 10  # thumbnails of the textured scenes, not blank
    target = Path(os.environ.get("DELTAS_MEMORY_IMAGE_PNG", "")) if os.environ.get(
        "DELTAS_MEMORY_IMAGE_PNG") else None
    if target:  # docs/node.md's picture: `DELTAS_MEMORY_IMAGE_PNG=docs/memory_image.png pytest`
        cv2.imwrite(str(target), cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR))


def test_memory_chunks_list_what_the_memory_holds(node):
    """~/memory_chunks after the stream: the chunks still held, oldest first, thinned or gone
    where evictions took them, the newest in the recent window, the rest in time buckets."""
    tester, _ = node
    tester.wait_for(lambda: tester.held and tester.drift
                    and tester.held[-1].header.stamp == tester.drift[-1].header.stamp)
    with tester.lock:
        held, last, times = tester.held[-1], tester.drift[-1], [m.stream_time for m in
                                                                 tester.drift]
    held_times, tokens, bucket = list(held.stream_time), list(held.tokens), list(held.bucket)
    assert held_times == sorted(set(held_times)) and held_times[-1] == last.stream_time
    assert set(held_times) < set(times)  # each is a chunk of ~/drift; evicted ones are gone
    assert len(tokens) == len(bucket) == len(held_times)
    assert 0 < sum(tokens) < last.kv_tokens  # the chat prefix's slots are not a chunk
    assert bucket[-1] == -1 and max(bucket) >= 1 and min(b for b in bucket if b >= 0) == 0


def markers_of(array: MarkerArray, ns: str) -> list[Marker]:
    return [m for m in array.markers if m.ns == ns]


def position(marker: Marker) -> list[float]:
    p = marker.pose.position
    return [p.x, p.y, p.z]


def test_memory_markers_place_every_held_chunk_at_its_pose(node):
    """~/memory_markers after the stream: DELETEALL first, an arrow per held chunk (its id the
    chunk's index) in the pose's frame at the pose its ~/drift message carries, the path through
    them oldest first, and stream-time labels."""
    tester, _ = node

    def current() -> bool:  # the newest markers show the newest held chunks
        if not (tester.markers and tester.held):
            return False
        times = {m.chunk_index: m.stream_time for m in tester.drift}
        shown = [times.get(m.id) for m in markers_of(tester.markers[-1], "chunks")]
        return shown == list(tester.held[-1].stream_time)

    tester.wait_for(current, timeout=120)
    with tester.lock:
        array, drift = tester.markers[-1], {m.chunk_index: m for m in tester.drift}
    assert array.markers[0].action == Marker.DELETEALL
    arrows = markers_of(array, "chunks")
    assert len(arrows) >= 2 and all(m.type == Marker.ARROW for m in arrows)
    for arrow in arrows:
        pose = drift[arrow.id].pose
        assert arrow.header.frame_id == pose.header.frame_id == "map"
        p, q, o = pose.pose.position, pose.pose.orientation, arrow.pose.orientation
        assert position(arrow) == pytest.approx([p.x, p.y, p.z], abs=1e-9)
        assert [o.x, o.y, o.z, o.w] == pytest.approx([q.x, q.y, q.z, q.w], abs=1e-9)
    (path,) = markers_of(array, "path")
    assert path.type == Marker.LINE_STRIP and path.header.frame_id == "map"
    assert [c for p in path.points for c in (p.x, p.y, p.z)] == pytest.approx(
        [c for a in arrows for c in position(a)], abs=1e-9)
    labels = markers_of(array, "labels")
    assert labels and all(m.type == Marker.TEXT_VIEW_FACING for m in labels)
    assert [m.text for m in labels] == [f"{drift[m.id].stream_time:.1f}s" for m in labels]


def check_evidence(tester: MemoryTester, reply, sent_before: int) -> None:
    """The markers published after `reply` (a newer message than the `sent_before`th) draw its
    evidence at the evidence poses, larger than the chunks, labelled with time and answer."""
    text = " ".join(reply.answer.split())[:40]
    assert reply.evidence_times and len(reply.evidence_poses) == len(reply.evidence_times)

    def shown() -> bool:
        return len(tester.markers) > sent_before and [
            m.text[:len(f"{t:.1f}s")] for m, t in zip(
                markers_of(tester.markers[-1], "answer"), reply.evidence_times)] == [
            f"{t:.1f}s" for t in reply.evidence_times]

    tester.wait_for(shown, timeout=60)
    with tester.lock:
        array = tester.markers[-1]
    big, labels = markers_of(array, "evidence"), markers_of(array, "answer")
    assert len(big) == len(labels) == len(reply.evidence_times)
    chunk = markers_of(array, "chunks")[0]
    for marker, label, pose in zip(big, labels, reply.evidence_poses):
        p = pose.pose.position
        assert marker.header.frame_id == pose.header.frame_id == "map"
        assert position(marker) == pytest.approx([p.x, p.y, p.z], abs=1e-9)
        assert marker.scale.x > chunk.scale.x and marker.color != chunk.color
        assert text in label.text


def test_memory_markers_show_the_latest_answers_evidence(node):
    """After a question, by the service and then by the action: its evidence chunks enlarged at
    their poses and labelled with the answer, until the next answer."""
    tester, _ = node
    with tester.lock:
        sent = len(tester.markers)
    reply = tester.call(tester.ask_client, AskMemory.Request(question="Where was the red cup?",
                                                             max_new_tokens=3), timeout=120)
    assert reply.success, reply.message
    check_evidence(tester, reply, sent)
    with tester.lock:
        sent = len(tester.markers)
    status, result, _ = tester.goal("What did you see last?", max_new_tokens=3)
    assert status == GoalStatus.STATUS_SUCCEEDED and result.success, result.message
    check_evidence(tester, result, sent)


def test_goals_are_rejected_while_the_node_is_not_active(node):
    """A planner gets an immediate no from an inactive node (deactivated, or configured without
    autostart), not a goal that fails later; activating again accepts goals again."""
    tester, _ = node
    goal = AskAction.Goal(question="What did you see?", max_new_tokens=2)
    assert tester.transition("deactivate") and tester.lifecycle_state() == "inactive"
    try:
        assert not send_goal(tester.action, goal).accepted
    finally:
        activated = tester.transition("activate")  # the module's node stays usable
    assert activated and tester.lifecycle_state() == "active"
    status, result, _ = tester.goal(goal.question, goal.max_new_tokens)
    assert status == GoalStatus.STATUS_SUCCEEDED and result.success, result.message


def test_a_goal_beyond_the_action_slots_is_rejected(node):
    """ACTION_SLOTS long goals running (one decoding, the others waiting for the worker): the
    next goal is rejected at once; a slot is free again when they end."""
    tester, _ = node
    feedback: list = []
    long = AskAction.Goal(question="What did you see?", max_new_tokens=4096)
    handles = [send_goal(tester.action, long, feedback=feedback) for _ in range(ACTION_SLOTS)]
    assert all(handle.accepted for handle in handles)
    results = [handle.get_result_async() for handle in handles]
    tester.wait_for(lambda: feedback, timeout=60)  # the first one decodes
    short = AskAction.Goal(question="What did you see?", max_new_tokens=2)
    assert not send_goal(tester.action, short).accepted
    for handle in handles:
        wait_future(handle.cancel_goal_async(), 60)
    # Both were still running when the extra goal came (cancelled, not finished): the queue
    # was full, and nothing else made the server refuse it.
    statuses = [wait_future(result, 120).status for result in results]
    assert statuses == [GoalStatus.STATUS_CANCELED] * ACTION_SLOTS
    status, result, _ = tester.goal(short.question, short.max_new_tokens)
    assert status == GoalStatus.STATUS_SUCCEEDED and result.success, result.message


def test_absurd_poses_are_refused_and_the_memory_stays_savable(node):
    """Odometry at x = 1e308 just before a chunk and -1e308 just after: the chunk's pose once
    interpolated to -inf and every save failed until the chunk was evicted."""
    tester, _ = node
    _, before = tester.last_status()
    chunks = len(tester.drift)
    start = BASE_STAMP + 14.0  # the module's stream goes on

    def absurd(x: float, stamp: float) -> None:
        msg = PoseStamped()
        msg.header.stamp, msg.header.frame_id = stamp_msg(stamp), "map"
        msg.pose.position.x, msg.pose.orientation.w = x, 1.0
        tester.pose_pub.publish(msg)

    def on_frame(i: int) -> None:
        tester.publish_pose(start + i / 30 + POSE_LEAD)
        if i == 25:  # around the chunk that ends at 1.0 s
            absurd(1e308, start + 0.99)
            absurd(-1e308, start + 1.01)

    tester.stream(3.0, speed=2.0, start=start, on_frame=on_frame)
    tester.wait_for(lambda: len(tester.drift) >= chunks + 3, timeout=120)
    status = tester.wait_for_status(
        lambda s: int(status_values(s)["poses_refused"]) == int(before["poses_refused"]) + 2)
    with tester.lock:
        for msg in tester.drift[chunks:]:
            assert_pose(msg.pose, seconds(msg.header.stamp))  # the good poses, interpolated
    assert saved_tensors(tester, "after_absurd_poses.safetensors")
    assert status_values(status)["saves_failed"] == before["saves_failed"]
