"""Where the robot was: a bounded buffer of stamped poses, read at a chunk's stamp.

    buffer = PoseBuffer(capacity=2000, max_gap_s=0.5)
    buffer.add(stamp, Pose("map", (x, y, z), (qx, qy, qz, qw)))   # from odometry / amcl
    pose = buffer.at(chunk_stamp)   # interpolated; None when no pose is near enough

Between the two poses around a stamp the position is interpolated linearly and the orientation
by slerp; before the first or after the last pose the nearest is used as it is (no
extrapolation). When the nearest pose is more than `max_gap_s` away, the pose is unknown (None):
a stale pose would put the evidence in the wrong place. ROS-free: the node converts messages.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .config import StreamConfig

MAX_FRAME_ID = 256  # characters of a frame id kept with a pose
# Farthest position accepted, in metres from the frame's origin: ten times Earth's radius, so
# ECEF and UTM coordinates pass, and 1e308 (whose interpolation overflows) does not.
MAX_POSITION_M = 1e8


@dataclass(frozen=True)
class Pose:
    """A pose in `frame_id`: position (x, y, z) in metres, orientation (x, y, z, w) unit
    quaternion."""

    frame_id: str
    position: tuple[float, float, float]
    orientation: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0)

    @classmethod
    def checked(cls, frame_id: str, position: Sequence[float],
                orientation: Sequence[float]) -> Pose:
        """A pose with a unit quaternion (normalised here) and a position within MAX_POSITION_M
        of the origin, or ValueError saying what is wrong."""
        if not isinstance(frame_id, str) or len(frame_id) > MAX_FRAME_ID:
            raise ValueError(f"a pose's frame_id must be a string of at most {MAX_FRAME_ID} "
                             f"characters")
        values = [float(v) for v in (*position, *orientation)]
        if len(values) != 7 or not all(math.isfinite(v) for v in values):
            raise ValueError("a pose needs 3 finite position and 4 finite orientation values")
        if max(abs(v) for v in values[:3]) > MAX_POSITION_M:
            raise ValueError(f"a pose's position {values[:3]} is more than {MAX_POSITION_M:g} m "
                             "from its frame's origin")
        norm = math.sqrt(sum(q * q for q in values[3:]))
        if norm < 1e-6:
            raise ValueError("a pose's orientation quaternion has zero length")
        if abs(norm - 1.0) > 1e-9:  # a unit quaternion is kept bit for bit (files round-trip)
            values[3:] = [q / norm for q in values[3:]]
        return cls(frame_id, tuple(values[:3]), tuple(values[3:]))

    def to_json(self) -> list:
        """[frame_id, x, y, z, qx, qy, qz, qw]: how a memory file stores it."""
        return [self.frame_id, *self.position, *self.orientation]

    @classmethod
    def from_json(cls, value: Any) -> Pose:
        """The pose `to_json` wrote, or ValueError (types, finiteness, quaternion)."""
        if (not isinstance(value, list) or len(value) != 8 or not isinstance(value[0], str)
                or not all(type(v) in (int, float) for v in value[1:])):
            raise ValueError(f"not a stored pose: {value!r:.80}")
        return cls.checked(value[0], value[1:4], value[4:])


def slerp(a: Sequence[float], b: Sequence[float], t: float) -> tuple[float, ...]:
    """Spherical interpolation between unit quaternions a and b (x, y, z, w) at t in [0, 1],
    along the shorter arc; normalised linear interpolation when they nearly coincide."""
    dot = sum(x * y for x, y in zip(a, b))
    if dot < 0:  # q and -q are the same rotation: take the short way
        b, dot = [-x for x in b], -dot
    if dot > 0.9995:
        mixed = [x + t * (y - x) for x, y in zip(a, b)]
    else:
        theta = math.acos(min(dot, 1.0))
        wa, wb = math.sin((1 - t) * theta), math.sin(t * theta)
        mixed = [(wa * x + wb * y) / math.sin(theta) for x, y in zip(a, b)]
    norm = math.sqrt(sum(x * x for x in mixed))
    return tuple(x / norm for x in mixed)


def interpolate(a: Pose, b: Pose, t: float) -> Pose:
    """The pose a fraction t of the way from a to b (a's frame). The weighted sum never leaves
    [min, max] of the two values, so it cannot overflow where y - x could."""
    position = tuple((1 - t) * x + t * y for x, y in zip(a.position, b.position))
    return Pose(a.frame_id, position, slerp(a.orientation, b.orientation, t))


class PoseBuffer:
    """The last `capacity` poses by stamp (seconds); out-of-order poses are inserted in place,
    the oldest dropped first. Not thread-safe: the node guards it with its lock."""

    def __init__(self, capacity: int = 2000,
                 max_gap_s: float = StreamConfig.pose_max_gap_s) -> None:
        if capacity < 2 or not max_gap_s > 0:
            raise ValueError("a pose buffer needs capacity >= 2 and max_gap_s > 0")
        self.capacity, self.max_gap_s = capacity, max_gap_s
        self._stamps: list[float] = []
        self._poses: list[Pose] = []

    def __len__(self) -> int:
        return len(self._stamps)

    def add(self, stamp: float, pose: Pose) -> None:
        """Keep `pose` at `stamp`; ValueError for a stamp that is not finite. A pose at a stamp
        already held replaces it."""
        if not math.isfinite(stamp):
            raise ValueError(f"a pose stamp must be finite, not {stamp}")
        i = bisect.bisect_left(self._stamps, stamp)
        if i < len(self._stamps) and self._stamps[i] == stamp:
            self._poses[i] = pose
            return
        self._stamps.insert(i, stamp)
        self._poses.insert(i, pose)
        if len(self._stamps) > self.capacity:
            del self._stamps[0], self._poses[0]

    def newest(self) -> float | None:
        """The stamp of the newest pose held (None when empty)."""
        return self._stamps[-1] if self._stamps else None

    def at(self, stamp: float | None) -> Pose | None:
        """The pose at `stamp`, interpolated between its neighbours; None when the stamp is
        unknown or no pose lies within max_gap_s of it."""
        if stamp is None or not math.isfinite(stamp) or not self._stamps:
            return None
        i = bisect.bisect_left(self._stamps, stamp)
        before = i - 1 if i > 0 else None
        after = i if i < len(self._stamps) else None
        gaps = [abs(self._stamps[j] - stamp) for j in (before, after) if j is not None]
        if min(gaps) > self.max_gap_s:
            return None
        if before is None or after is None:
            return self._poses[after if before is None else before]
        t0, t1 = self._stamps[before], self._stamps[after]
        return interpolate(self._poses[before], self._poses[after], (stamp - t0) / (t1 - t0))
