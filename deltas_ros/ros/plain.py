"""Messages as plain data, for JSON (the dashboard's page, `deltas-ros ask --all --json`)."""

from __future__ import annotations

from typing import Any


def seconds(stamp: Any) -> float:
    """A builtin_interfaces/Time in seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def pose_dict(pose: Any) -> dict | None:
    """A PoseStamped as plain numbers; None when unknown (the messages' empty frame_id)."""
    if not pose.header.frame_id:
        return None
    p, q = pose.pose.position, pose.pose.orientation
    return {"frame_id": pose.header.frame_id, "x": p.x, "y": p.y, "z": p.z,
            "qx": q.x, "qy": q.y, "qz": q.z, "qw": q.w}
