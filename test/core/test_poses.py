"""The pose buffer on a synthetic pose stream: interpolation, slerp, gaps, bounds, storage."""

import math

import pytest

from deltas_ros.core.poses import MAX_POSITION_M, Pose, PoseBuffer, interpolate, slerp


def yaw_pose(x: float, yaw: float, frame: str = "map") -> Pose:
    return Pose.checked(frame, (x, 2 * x, 0.0), (0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2)))


def yaw_of(pose: Pose) -> float:
    return 2 * math.atan2(pose.orientation[2], pose.orientation[3])


def circle_stream(buffer: PoseBuffer, stamps) -> None:
    """A robot driving along x at 1 m/s, turning at 0.5 rad/s."""
    for t in stamps:
        buffer.add(t, yaw_pose(t, 0.5 * t))


def test_interpolates_position_linearly_and_orientation_by_slerp():
    buffer = PoseBuffer(max_gap_s=0.6)
    circle_stream(buffer, [10.0, 10.5, 11.0, 11.5])
    pose = buffer.at(10.8)
    assert pose.position == pytest.approx((10.8, 21.6, 0.0))
    assert pose.orientation == pytest.approx(yaw_pose(10.8, 5.4).orientation)  # uniform turn
    assert math.hypot(*pose.orientation) == pytest.approx(1.0)
    assert buffer.at(11.0) == yaw_pose(11.0, 5.5)


def test_slerp_takes_the_short_arc_at_constant_rate():
    a, b = yaw_pose(0, 0.0).orientation, yaw_pose(0, math.pi / 2).orientation
    for t in (0.25, 0.5, 0.75):
        q = slerp(a, b, t)
        assert 2 * math.atan2(q[2], q[3]) == pytest.approx(t * math.pi / 2)
    negated = tuple(-x for x in b)  # the same rotation: still a quarter turn, not three
    q = slerp(a, negated, 0.5)
    assert abs(2 * math.atan2(q[2], q[3])) == pytest.approx(math.pi / 4)
    assert interpolate(yaw_pose(0, 0), yaw_pose(2, 0), 0.5).position == (1.0, 2.0, 0.0)


def test_no_pose_when_the_nearest_is_too_far():
    buffer = PoseBuffer(max_gap_s=0.5)
    assert buffer.at(1.0) is None  # empty
    circle_stream(buffer, [10.0, 12.0])
    assert buffer.at(11.0) is None  # 1 s from both neighbours
    assert buffer.at(10.4) is not None and buffer.at(12.5) == yaw_pose(12.0, 6.0)  # held, no
    assert buffer.at(12.6) is None and buffer.at(9.4) is None                     # extrapolation
    assert buffer.at(None) is None and buffer.at(math.nan) is None


def test_bounded_and_out_of_order():
    buffer = PoseBuffer(capacity=4, max_gap_s=1.0)
    circle_stream(buffer, [3.0, 1.0, 2.0, 5.0, 4.0, 6.0])
    assert len(buffer) == 4 and buffer.at(3.0) == yaw_pose(3.0, 1.5)
    assert buffer.at(1.0) is None  # the oldest went first
    buffer.add(6.0, yaw_pose(60.0, 0.0))  # same stamp: replaced
    assert len(buffer) == 4 and buffer.at(6.0).position[0] == 60.0
    with pytest.raises(ValueError, match="finite"):
        buffer.add(math.inf, yaw_pose(0, 0))


@pytest.mark.parametrize("args", [("map", (0, 0, math.nan), (0, 0, 0, 1)),
                                  ("map", (0, 0, 0), (0, 0, 0, 0)),
                                  ("map", (0, 0), (0, 0, 0, 1)),
                                  ("m" * 300, (0, 0, 0), (0, 0, 0, 1))])
def test_bad_poses_are_refused(args):
    with pytest.raises(ValueError):
        Pose.checked(*args)


def test_json_round_trip_and_refusals():
    pose = Pose.checked("odom", (1, 2, 3), (0, 0, 2, 0))  # normalised on the way in
    assert pose.orientation == (0.0, 0.0, 1.0, 0.0)
    assert Pose.from_json(pose.to_json()) == pose
    for bad in (["odom", 1, 2, 3, 0, 0, 0, 0], ["odom", "1", 2, 3, 0, 0, 0, 1], "x",
                ["odom", 1, 2, 3, 0, 0, 1], [1, 1, 2, 3, 0, 0, 0, 1]):
        with pytest.raises(ValueError):
            Pose.from_json(bad)


def test_absurd_positions_are_refused_and_interpolation_cannot_overflow():
    with pytest.raises(ValueError, match="from its frame's origin"):
        Pose.checked("odom", (1e308, 0, 0), (0, 0, 0, 1))
    far = MAX_POSITION_M
    a, b = Pose.checked("utm", (far, -far, 0), (0, 0, 0, 1)), \
        Pose.checked("utm", (-far, far, 0), (0, 0, 0, 1))
    assert Pose.checked("utm", (6.4e6, 5e6, 0), (0, 0, 0, 1))  # ECEF / UTM coordinates pass
    huge = Pose("odom", (1.7e308, -1.7e308, 0.0))  # not checked: interpolation must hold anyway
    for t in (0.0, 0.3, 1.0):
        assert all(map(math.isfinite, interpolate(a, b, t).position))
        assert all(map(math.isfinite, interpolate(huge, Pose("odom", (-1.7e308, 1.7e308, 0.0)),
                                                  t).position))
