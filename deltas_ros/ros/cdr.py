"""The header of a serialized sensor_msgs Image / CompressedImage, read from its CDR bytes.

Why: the camera sends 30 frames a second and the sampler keeps ~2. Deserializing a 2.7 MB rgb8
frame into Python objects only to read its stamp and drop it is most of the camera path's CPU.
With a raw subscription (rclpy `raw=True`) the callback gets the serialized bytes; the header sits
at the very start of both message types, so its stamp is two integers at a fixed offset, and only
the frames the sampler keeps are deserialized and decoded.

Layout (OMG CDR, as rmw serializes ROS 2 messages), offsets in bytes:

    0   representation id (2 bytes, big-endian): 0x0000 CDR big-endian, 0x0001 CDR little-endian
    2   options (2 bytes, unused)
    4   header.stamp.sec      int32    (alignment is relative to byte 4, the body's start)
    8   header.stamp.nanosec  uint32
    12  header.frame_id       uint32 length n (including the terminating NUL), then n bytes

Pure Python, no ROS import: tested against rclpy's serialize_message in test_cdr.
"""

from __future__ import annotations

import struct

from ..core.decode import UNSET_STAMP, stamp_to_seconds

CDR_BE, CDR_LE = b"\x00\x00", b"\x00\x01"
_STAMP = {CDR_BE: struct.Struct(">iI"), CDR_LE: struct.Struct("<iI")}  # sec, nanosec
_LENGTH = {CDR_BE: struct.Struct(">I"), CDR_LE: struct.Struct("<I")}  # frame_id's length
_BODY = 4  # the encapsulation header's size; the stamp starts here, frame_id 8 bytes later


def _stamp_of(data: memoryview) -> tuple[int, int, bytes]:
    representation = bytes(data[:2])
    layout = _STAMP.get(representation)
    if layout is None:
        raise ValueError(f"not a plain CDR message (representation {representation.hex()})")
    if len(data) < _BODY + layout.size:
        raise ValueError(f"serialized message too short for a header ({len(data)} bytes)")
    sec, nanosec = layout.unpack_from(data, _BODY)
    return sec, nanosec, representation


def raw_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, str]:
    """(sec, nanosec, frame_id) of a serialized message that starts with a std_msgs/Header.

    ValueError (the frame is dropped and counted, like any bad frame) for bytes that are not a
    plain CDR encapsulation, too short for the header, or whose frame_id is not NUL-terminated
    UTF-8 inside the message.
    """
    data = memoryview(raw).cast("B")
    sec, nanosec, representation = _stamp_of(data)
    at = _BODY + 8
    if len(data) < at + 4:
        raise ValueError(f"serialized message too short for a header ({len(data)} bytes)")
    (length,) = _LENGTH[representation].unpack_from(data, at)
    start = at + 4
    if length < 1 or start + length > len(data) or data[start + length - 1] != 0:
        raise ValueError("serialized header has a malformed frame_id")
    return sec, nanosec, str(data[start:start + length - 1], "utf-8")


def raw_stamp(raw: bytes | bytearray | memoryview) -> float:
    """The header stamp in seconds as decode.message_stamp gives it for the deserialized message
    (UNSET_STAMP for an unset header): two integers at byte 4, nothing else is read."""
    sec, nanosec, _ = _stamp_of(memoryview(raw).cast("B"))
    if sec == 0 and nanosec == 0:
        return UNSET_STAMP
    return stamp_to_seconds(sec, nanosec)
