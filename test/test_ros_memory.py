"""ros_memory's message side without a ROS graph: pose_of for every pose_type a robot can feed
(nav_msgs/Odometry from odometry, PoseWithCovarianceStamped from amcl, PoseStamped)."""

from __future__ import annotations

import math

import pytest
from geometry_msgs.msg import PoseStamped, PoseWithCovarianceStamped
from nav_msgs.msg import Odometry

from deltas_ros.poses import Pose, PoseBuffer
from deltas_ros.ros_adapters import to_time_msg
from deltas_ros.ros_memory import POSE_TYPES, pose_of

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
