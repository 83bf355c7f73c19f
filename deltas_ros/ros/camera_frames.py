"""One camera frame in the node: its message from the CDR bytes, and what the camera callback
logs about the frame's outcome at the gate."""

from __future__ import annotations

from typing import Any

from rclpy.serialization import deserialize_message

from ..core.decode import FrameError
from ..core.frames import GateOutcome, TimeEvent


def deserialize_frame(raw: bytes, msg_type: type) -> Any:
    """A camera message from its CDR bytes; FrameError saying so for bytes that are not one
    (rclpy's own error reads "failed to deserialize ROS message: error not set")."""
    try:
        return deserialize_message(raw, msg_type)
    except Exception as error:  # rclpy raises RMWError / RuntimeError kinds
        raise FrameError(f"malformed {msg_type.__name__} message ({len(raw)} bytes): it cannot "
                         f"be deserialized ({type(error).__name__})") from None


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
