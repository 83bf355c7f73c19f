"""The header read from CDR bytes (deltas_ros.ros.cdr) against rclpy's own serialization, and
the raw camera path's sampling against the deserializing one on the same streams."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import CompressedImage, Image

from deltas_ros.core.decode import decode_message, message_stamp
from deltas_ros.core.frames import FrameGate, FrameSampler
from deltas_ros.ros.cdr import raw_header, raw_stamp


def image(sec: int, nanosec: int, frame_id: str, width: int = 4, height: int = 2) -> Image:
    msg = Image(height=height, width=width, encoding="rgb8", step=3 * width)
    msg.header.stamp.sec, msg.header.stamp.nanosec, msg.header.frame_id = sec, nanosec, frame_id
    msg.data = bytes((np.arange(height * width * 3) * 7 % 256).astype(np.uint8))
    return msg


def compressed(sec: int, nanosec: int, frame_id: str) -> CompressedImage:
    msg = CompressedImage(format="jpeg", data=b"\xff\xd8 not a real jpeg")
    msg.header.stamp.sec, msg.header.stamp.nanosec, msg.header.frame_id = sec, nanosec, frame_id
    return msg


def big_endian(raw: bytes) -> bytes:
    """The same header in CDR big-endian (rclpy only writes the host's order): the header's
    integers swapped, the rest unchanged (the header is all raw_header reads)."""
    sec, nanosec, length = struct.unpack_from("<iII", raw, 4)
    return b"\x00\x00" + raw[2:4] + struct.pack(">iII", sec, nanosec, length) + raw[16:]


STAMPS = st.tuples(st.integers(-2**31, 2**31 - 1), st.integers(0, 2**32 - 1))


# No NUL: a ROS string ends at its first NUL (C strings), which the CDR reader follows. UTF-8
# only: rclpy cannot serialize a lone surrogate ('\ud800'), which hypothesis otherwise draws.
NO_NUL = st.characters(codec="utf-8", exclude_characters="\x00")


@settings(max_examples=60, deadline=None)
@given(stamp=STAMPS, frame_id=st.text(NO_NUL, max_size=9),
       kind=st.sampled_from([image, compressed]))
def test_header_equals_rclpy_for_both_types_odd_frame_ids_and_both_endiannesses(
        stamp, frame_id, kind):
    msg = kind(*stamp, frame_id)
    raw = serialize_message(msg)
    assert raw[:2] == b"\x00\x01"  # rclpy on this (little-endian) host
    for data in (raw, big_endian(raw), bytearray(raw), memoryview(raw)):
        assert raw_header(data) == (*stamp, frame_id)
        expected, got = message_stamp(msg), raw_stamp(data)
        assert got == expected or (math.isnan(got) and math.isnan(expected))


def test_every_frame_id_length_mod_4_reads_the_same_header():
    for n in range(9):  # the NUL-terminated length crosses every alignment of the next field
        msg = image(12, 345, "f" * n)
        assert raw_header(serialize_message(msg)) == (12, 345, "f" * n)


def test_unset_header_is_nan_like_message_stamp():
    assert math.isnan(raw_stamp(serialize_message(image(0, 0, "cam"))))


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x01\x00\x00\x01", b"\x00\x07" + bytes(20),
                                  b"\x00\x01\x00\x00" + bytes(8) + struct.pack("<I", 99) + b"ab"])
def test_malformed_bytes_raise_value_error(data):
    with pytest.raises(ValueError):
        raw_header(data)
    if len(data) < 12 or data[:2] != b"\x00\x01":
        with pytest.raises(ValueError):
            raw_stamp(data)


def test_frame_id_must_be_nul_terminated_utf8():
    raw = bytearray(serialize_message(image(1, 2, "ab")))
    raw[12 + 4 + 2] = ord("x")  # the NUL
    with pytest.raises(ValueError):
        raw_header(raw)
    raw = bytearray(serialize_message(image(1, 2, "ab")))
    raw[16] = 0xFF
    with pytest.raises(ValueError):
        raw_header(raw)


def stream(seed: int, count: int = 300) -> list[Image]:
    """A 30 fps camera with jitter, a stall, an unset stamp, a jump back and duplicates."""
    rng = np.random.default_rng(seed)
    t, msgs = 100.0, []
    for i in range(count):
        t += 1 / 30 + rng.normal(0, 0.003)
        if i == 120:
            t += 4.0  # a gap
        if i == 200:
            t -= 50.0  # a looped bag
        stamp = (0, 0) if i == 50 else (int(t), int(round((t % 1) * 1e9)) % 10**9)
        msgs.append(image(*stamp, f"cam{i % 3}", width=6, height=4))
        if i % 37 == 0:
            msgs.append(msgs[-1])
    return msgs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_raw_path_samples_and_decodes_exactly_what_the_deserializing_path_does(seed):
    old, new = FrameGate(FrameSampler()), FrameGate(FrameSampler())
    decoded = 0
    for msg in stream(seed):
        raw = serialize_message(msg)
        a = old.push(message_stamp(msg), lambda msg=msg: decode_message(msg))

        def decode_raw(raw: bytes = raw) -> np.ndarray:
            nonlocal decoded
            decoded += 1
            return decode_message(deserialize_message(raw, Image))

        b = new.push(raw_stamp(raw), decode_raw)
        assert (a.event, a.error) == (b.event, b.error)
        assert [c.stamps for c in a.chunks] == [c.stamps for c in b.chunks]
        for x, y in zip(a.chunks, b.chunks):
            assert all(np.array_equal(p, q) for p, q in zip(x.frames, y.frames))
    assert old.bad_stamps == new.bad_stamps == 1
    assert 0 < decoded < 330 / 5  # only sampled frames were deserialized (~2 of 30 fps)
