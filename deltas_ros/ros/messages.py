"""Messages the node builds from its own records: a stamp, a chunk's DriftScore, the
/diagnostics array."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from std_msgs.msg import Header

from ..core.results import DriftRecord
from ..msg import DriftScore


def to_time_msg(seconds: float) -> Time:
    sec = int(seconds // 1)
    return Time(sec=sec, nanosec=min(int(round((seconds - sec) * 1e9)), 999_999_999))


def drift_message(record: DriftRecord, frame_id: str) -> DriftScore:
    """One chunk's DriftScore, field for field its record; its pose (memory_io.pose_stamped)
    is set by the caller."""
    fields = asdict(record)
    msg = DriftScore(**{name: value for name, value in fields.items() if name != "stamp"})
    msg.header.stamp = to_time_msg(record.stamp)
    msg.header.frame_id = frame_id
    return msg


def diagnostics_message(stamp: Time, name: str, level: int, message: str, hardware_id: str,
                        values: dict[str, Any]) -> DiagnosticArray:
    status = DiagnosticStatus(level=bytes([level]), name=name, message=message,
                              hardware_id=hardware_id,
                              values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])
    return DiagnosticArray(header=Header(stamp=stamp), status=[status])
