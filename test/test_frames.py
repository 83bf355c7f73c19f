"""The frame gate without ROS: decoding sensor_msgs image fields, and sampling by header stamp."""

from __future__ import annotations

import array
import random
import time

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltas_ros.frames import (
    SUPPORTED_ENCODINGS,
    FrameError,
    FrameGate,
    FrameSampler,
    SampledChunk,
    TimeEvent,
    decode_compressed,
    decode_message,
    decode_raw,
    stamp_to_seconds,
)

BASE = 1_700_000_000.0  # a realistic epoch stamp: float precision matters at this magnitude
DEPTH_ENCODINGS = ("mono16", "16UC1", "32FC1", "rgb16", "bgr16", "rgba16", "bgra16", "16SC1")
DATA_TYPES = {
    "bytes": bytes,
    "bytearray": bytearray,
    "memoryview": lambda raw: memoryview(bytearray(raw)),
    "array": lambda raw: array.array("B", raw),  # what rclpy gives
    "numpy": lambda raw: np.frombuffer(raw, dtype=np.uint8).copy(),  # what rosbags gives
}


def test_stamp_to_seconds_is_arithmetic():
    assert stamp_to_seconds(1, 500_000_000) == 1.5
    assert stamp_to_seconds(1, 5) == pytest.approx(1.000000005, abs=1e-12)  # not "1.5"
    assert stamp_to_seconds(1_700_000_000, 0) == BASE


# --- decode_raw -----------------------------------------------------------------------------


def _rgb_image(height: int = 3, width: int = 4) -> np.ndarray:
    """(height, width, 3) uint8 with distinct values per pixel and channel."""
    return np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _encode_raw(rgb: np.ndarray, encoding: str, pad: int) -> tuple[bytes, int, np.ndarray]:
    """sensor_msgs/Image data and step for `rgb`, rows padded by `pad` junk bytes; also the RGB
    decode_raw should give back (mono8 keeps only the gray level)."""
    height, width, _ = rgb.shape
    alpha = np.full((height, width, 1), 77, dtype=np.uint8)
    gray = rgb[..., :1]
    pixels = {
        "rgb8": rgb,
        "bgr8": rgb[..., ::-1],
        "rgba8": np.concatenate([rgb, alpha], axis=2),
        "bgra8": np.concatenate([rgb[..., ::-1], alpha], axis=2),
        "mono8": gray,
    }[encoding]
    expected = np.repeat(gray, 3, axis=2) if encoding == "mono8" else rgb
    rows = pixels.reshape(height, -1)
    junk = np.full((height, pad), 0xEE, dtype=np.uint8)
    padded = np.concatenate([rows, junk], axis=1)
    return padded.tobytes(), padded.shape[1], expected


@pytest.mark.parametrize("data_type", DATA_TYPES)
@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("encoding", SUPPORTED_ENCODINGS)
def test_decode_raw_round_trips(encoding, pad, data_type):
    raw, step, expected = _encode_raw(_rgb_image(), encoding, pad)
    data = DATA_TYPES[data_type](raw)

    frame = decode_raw(encoding, 3, 4, step, data)

    assert frame.shape == (3, 4, 3)
    assert frame.dtype == np.uint8
    assert frame.flags.c_contiguous and frame.flags.writeable
    np.testing.assert_array_equal(frame, expected)


def test_decode_raw_result_does_not_alias_the_message_buffer():
    raw, step, expected = _encode_raw(_rgb_image(), "rgb8", 0)
    data = np.frombuffer(raw, dtype=np.uint8).copy()
    frame = decode_raw("rgb8", 3, 4, step, data)
    data[:] = 0
    np.testing.assert_array_equal(frame, expected)


def test_decode_raw_ignores_byte_order_of_8_bit_data():
    raw, step, expected = _encode_raw(_rgb_image(), "bgr8", 2)
    np.testing.assert_array_equal(decode_raw("bgr8", 3, 4, step, raw, is_bigendian=True), expected)


def test_decode_raw_accepts_trailing_bytes():
    raw, step, expected = _encode_raw(_rgb_image(), "rgba8", 0)
    np.testing.assert_array_equal(decode_raw("rgba8", 3, 4, step, raw + b"\0" * 7), expected)


def test_decode_raw_refuses_unknown_encoding():
    with pytest.raises(FrameError, match="unknown encoding 'yuv422'") as info:
        decode_raw("yuv422", 2, 2, 4, bytes(8))
    assert all(encoding in str(info.value) for encoding in SUPPORTED_ENCODINGS)


@pytest.mark.parametrize("encoding", DEPTH_ENCODINGS)
def test_decode_raw_refuses_depth_and_16_bit(encoding):
    with pytest.raises(FrameError) as info:
        decode_raw(encoding, 2, 2, 16, bytes(32))
    message = str(info.value)
    assert encoding in message
    assert "depth" in message and "16-bit" in message and "not supported" in message
    assert all(supported in message for supported in SUPPORTED_ENCODINGS)


@pytest.mark.parametrize(
    ("height", "width", "step", "size", "expected"),
    [
        (0, 4, 12, 0, "height=0"),
        (3, 0, 12, 36, "width=0"),
        (3, 4, 11, 36, "step 11 smaller than width\\*channels"),
        (3, 4, 12, 35, "data shorter than step\\*height"),
        (3, 4, 16, 47, "data shorter than step\\*height"),  # padding counts on the last row too
    ],
)
def test_decode_raw_refuses_bad_geometry(height, width, step, size, expected):
    with pytest.raises(FrameError, match=expected):
        decode_raw("rgb8", height, width, step, bytes(size))


RAW_ENCODINGS = (*SUPPORTED_ENCODINGS, *DEPTH_ENCODINGS, "", "RGB8", "yuv422", "bayer_rggb8")


@settings(max_examples=200, deadline=None)
@given(
    encoding=st.sampled_from(RAW_ENCODINGS),
    height=st.integers(0, 6),
    width=st.integers(0, 6),
    step=st.integers(0, 30),
    raw=st.binary(max_size=200),
    data_type=st.sampled_from(sorted(DATA_TYPES)),
    is_bigendian=st.booleans(),
)
def test_decode_raw_fuzz_only_raises_frame_error(
    encoding, height, width, step, raw, data_type, is_bigendian
):
    try:
        frame = decode_raw(encoding, height, width, step, DATA_TYPES[data_type](raw), is_bigendian)
    except FrameError:
        return
    assert frame.shape == (height, width, 3)
    assert frame.dtype == np.uint8


# --- decode_compressed ----------------------------------------------------------------------


def _smooth_rgb(height: int = 32, width: int = 48) -> np.ndarray:
    """A gradient: survives JPEG with small error, unlike noise."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 5, y * 7, (x + y) * 3], axis=2).astype(np.uint8)


def _encoded(ext: str, image: np.ndarray) -> bytes:
    ok, buffer = cv2.imencode(ext, image)
    assert ok
    return buffer.tobytes()


@pytest.mark.parametrize("format", ["jpeg", "rgb8; jpeg compressed bgr8"])
def test_decode_compressed_jpeg(format):
    rgb = _smooth_rgb()
    data = _encoded(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))

    frame = decode_compressed(format, data)

    assert frame.shape == rgb.shape and frame.dtype == np.uint8
    assert np.abs(frame.astype(int) - rgb).mean() < 3  # lossy, but no channel swap


@pytest.mark.parametrize("data_type", DATA_TYPES)
def test_decode_compressed_png_is_exact(data_type):
    rgb = _rgb_image(5, 7)
    data = DATA_TYPES[data_type](_encoded(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)))
    np.testing.assert_array_equal(decode_compressed("png", data), rgb)


def test_decode_compressed_gray_and_bgra_png_become_rgb():
    rgb = _rgb_image(5, 7)
    gray = rgb[..., 0]
    bgra = np.concatenate([rgb[..., ::-1], np.full((5, 7, 1), 9, np.uint8)], axis=2)

    from_gray = decode_compressed("png", _encoded(".png", gray))
    from_bgra = decode_compressed("png", _encoded(".png", bgra))

    np.testing.assert_array_equal(from_gray, np.repeat(gray[..., None], 3, axis=2))
    np.testing.assert_array_equal(from_bgra, rgb)


@pytest.mark.parametrize(
    ("format", "data", "expected"),
    [
        ("jpeg", b"", "empty"),
        ("jpeg", b"definitely not an image", "cannot decode"),
        ("png", b"\x89PNG\r\n\x1a\n" + bytes(40), "cannot decode"),
        ("16UC1; compressedDepth", b"\0" * 12 + b"\x89PNG\r\n\x1a\n", "depth"),
    ],
)
def test_decode_compressed_refuses(format, data, expected):
    with pytest.raises(FrameError, match=expected):
        decode_compressed(format, data)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300), format=st.sampled_from(["jpeg", "png", ""]))
def test_decode_compressed_fuzz_only_raises_frame_error(raw, format):
    try:
        frame = decode_compressed(format, raw)
    except FrameError:
        return
    assert frame.ndim == 3 and frame.shape[2] == 3 and frame.dtype == np.uint8


# --- FrameSampler ---------------------------------------------------------------------------


def camera(seconds: float, rate: float = 30.0, start: float = BASE, jitter: float = 0.0,
           seed: int = 0) -> list[float]:
    """Header stamps of a camera at `rate`, each off by up to +-jitter seconds."""
    rng = random.Random(seed)
    return [start + i / rate + rng.uniform(-jitter, jitter) for i in range(round(seconds * rate))]


def frame_for(stamp: float, shape: tuple[int, ...] = (2, 2, 3)) -> np.ndarray:
    """A frame whose pixels tell which stamp it came from."""
    return np.full(shape, int(stamp * 30) % 256, dtype=np.uint8)


def run(sampler: FrameSampler, stamps: list[float]) -> tuple[list[SampledChunk], list[bool]]:
    """Feed stamps the way the node does; the chunks emitted and which stamps were wanted."""
    chunks, wanted = [], []
    for stamp in stamps:
        sampler.observe(stamp)
        wanted.append(sampler.wants(stamp))
        if wanted[-1] and (chunk := sampler.add(frame_for(stamp), stamp)) is not None:
            chunks.append(chunk)
    return chunks, wanted


@pytest.mark.parametrize("jitter", [0.0, 0.002])
def test_sampler_takes_two_of_thirty_frames_per_second(jitter):
    sampler = FrameSampler(fps=2.0, frames_per_chunk=2)
    stamps = camera(10.0, jitter=jitter)

    chunks, wanted = run(sampler, stamps)

    assert sum(wanted) == 20
    assert [sum(wanted[i : i + 30]) for i in range(0, 300, 30)] == [2] * 10
    assert [chunk.index for chunk in chunks] == list(range(10))
    assert all(len(c.frames) == len(c.stamps) == len(c.times) == 2 for c in chunks)
    times = [t for chunk in chunks for t in chunk.times]
    assert times[0] == 0.0
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times == pytest.approx([k / 2 for k in range(20)], abs=0.005)
    assert (sampler.received, sampler.sampled, sampler.chunks) == (300, 20, 10)
    assert (sampler.dropped_frames, sampler.time_jumps_back, sampler.time_gaps) == (0, 0, 0)


def test_sampler_is_deterministic_and_ignores_arrival_time(monkeypatch):
    stamps = camera(5.0, jitter=0.002, seed=3)

    def arrival_time_used():
        raise AssertionError("the sampler must not read the clock")

    with monkeypatch.context() as patch:
        for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
            patch.setattr(time, name, arrival_time_used)
        first, _ = run(FrameSampler(), stamps)
        second, _ = run(FrameSampler(), stamps)

    assert len(first) == len(second) == 5
    for a, b in zip(first, second):
        assert (a.index, a.stamps, a.times) == (b.index, b.stamps, b.times)
        for frame_a, frame_b in zip(a.frames, b.frames):
            np.testing.assert_array_equal(frame_a, frame_b)


def test_wants_is_pure():
    sampler = FrameSampler()
    sampler.observe(BASE)
    assert sampler.wants(BASE) and sampler.wants(BASE)
    sampler.add(frame_for(BASE), BASE)
    assert not sampler.wants(BASE + 0.1)
    assert not sampler.wants(BASE + 0.1)
    assert sampler.wants(BASE + 0.5)
    assert (sampler.received, sampler.sampled) == (1, 1)


def test_jump_back_starts_a_new_stream():
    sampler = FrameSampler()
    before, _ = run(sampler, camera(1.2))  # samples at 0, 0.5 (chunk 0) and 1.0 (partial)
    restart = BASE - 100.0

    assert sampler.observe(restart) is TimeEvent.JUMP_BACK
    assert (sampler.time_jumps_back, sampler.dropped_frames) == (1, 1)
    assert sampler.wants(restart)
    sampler.add(frame_for(restart), restart)
    after, _ = run(sampler, camera(1.0, start=restart)[1:])

    assert [c.index for c in before] == [0]
    assert [c.index for c in after] == [0]
    assert after[0].stamps[0] == restart
    assert after[0].times == pytest.approx([0.0, 0.5], abs=1e-6)


def test_small_backward_jitter_is_not_a_jump():
    sampler = FrameSampler(tolerance_s=0.005)
    sampler.observe(BASE)
    assert sampler.observe(BASE - 0.003) is TimeEvent.NONE
    assert sampler.observe(BASE - 0.010) is TimeEvent.JUMP_BACK


def test_gap_keeps_stream_time_and_restarts_the_grid():
    sampler = FrameSampler(max_gap_s=10.0)
    before, _ = run(sampler, camera(1.2))  # chunk 0, and a partial chunk of one frame at 1.0
    resume = BASE + 61.3  # off the old 0.5 s grid

    assert sampler.observe(resume) is TimeEvent.GAP
    assert (sampler.time_gaps, sampler.dropped_frames) == (1, 1)
    assert sampler.wants(resume)
    sampler.add(frame_for(resume), resume)
    after, _ = run(sampler, camera(1.0, start=resume)[1:])

    assert [c.index for c in before + after] == [0, 1]  # same stream: indices continue
    assert after[0].stamps == pytest.approx([resume, resume + 0.5], abs=1e-6)  # new grid
    assert after[0].times == pytest.approx([61.3, 61.8], abs=1e-6)  # the gap shows in time
    assert after[0].times[0] > before[0].times[-1]


def test_forward_step_below_max_gap_is_not_a_gap():
    sampler = FrameSampler(max_gap_s=10.0)
    sampler.observe(BASE)
    assert sampler.observe(BASE + 9.9) is TimeEvent.NONE
    assert sampler.observe(BASE + 20.0) is TimeEvent.GAP


def test_failed_decode_leaves_the_slot_open():
    sampler = FrameSampler()
    stamps = camera(1.2)
    wanted = []
    for i, stamp in enumerate(stamps):
        sampler.observe(stamp)
        wanted.append(sampler.wants(stamp))
        if wanted[-1] and i != 15:  # frame 15 fails to decode: no add()
            sampler.add(frame_for(stamp), stamp)

    assert [i for i, w in enumerate(wanted) if w] == [0, 15, 16, 30]  # grid did not drift
    assert sampler.sampled == 3


def test_missing_frames_skip_their_slots():
    sampler = FrameSampler()
    stamps = camera(0.4) + camera(0.8, start=BASE + 1.2)  # nothing from 0.4 s to 1.2 s

    _, wanted = run(sampler, stamps)

    sampled = [round(s - BASE, 3) for s, w in zip(stamps, wanted) if w]
    assert sampled == [0.0, 1.2, 1.5]  # 0.5 and 1.0 are gone, not caught up twice


def test_resolution_change_mid_chunk_drops_the_partial_chunk():
    sampler = FrameSampler(fps=2.0, frames_per_chunk=3)
    small, large = (2, 2, 3), (4, 6, 3)
    results = []
    for k, shape in enumerate([small, small, large, large, large]):
        stamp = BASE + k / 2
        sampler.observe(stamp)
        assert sampler.wants(stamp)
        results.append(sampler.add(frame_for(stamp, shape), stamp))

    assert results[:4] == [None] * 4
    chunk = results[4]
    assert chunk is not None and chunk.index == 0
    assert [f.shape for f in chunk.frames] == [large] * 3
    assert chunk.stamps == [BASE + 1.0, BASE + 1.5, BASE + 2.0]
    assert chunk.times == [1.0, 1.5, 2.0]
    assert (sampler.dropped_frames, sampler.chunks) == (2, 1)


def test_reset_forgets_the_stream():
    sampler = FrameSampler()
    run(sampler, camera(1.2))  # chunk 0, and a partial chunk of one frame

    sampler.reset()
    later = BASE + 3.3  # forward, within max_gap_s: only the reset makes it a new stream
    chunks, _ = run(sampler, camera(1.0, start=later))

    assert sampler.dropped_frames == 1
    assert (sampler.time_jumps_back, sampler.time_gaps) == (0, 0)
    assert [c.index for c in chunks] == [0]
    assert chunks[0].times == pytest.approx([0.0, 0.5], abs=1e-6)


def test_add_before_observe_is_an_error():
    with pytest.raises(RuntimeError, match="observe"):
        FrameSampler().add(frame_for(BASE), BASE)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"fps": 0.0}, "fps"),
        ({"fps": -2.0}, "fps"),
        ({"frames_per_chunk": 0}, "frames_per_chunk"),
        ({"max_gap_s": 0.0}, "max_gap_s"),
        ({"tolerance_s": -0.001}, "tolerance_s"),
        ({"tolerance_s": 0.25}, "tolerance_s"),  # half of a 0.5 s period
    ],
)
def test_sampler_validates_arguments(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        FrameSampler(**kwargs)


def test_frame_gate_decodes_only_sampled_frames_and_counts_bad_ones():
    gate = FrameGate(FrameSampler(fps=2.0, frames_per_chunk=2))
    decoded, chunks = [], []

    def decoder(i: int):
        def decode() -> np.ndarray:
            decoded.append(i)
            if i == 15:
                raise FrameError("corrupt")
            return np.zeros((4, 4, 3), np.uint8)
        return decode

    for i in range(60):
        outcome = gate.push(100.0 + i / 30, decoder(i))
        if outcome.chunk is not None:
            chunks.append(outcome.chunk)
        assert outcome.error == ("corrupt" if i == 15 else "")
    assert decoded == [0, 15, 16, 30, 45]  # the bad frame's slot stays open for the next one
    assert gate.bad_frames == 1 and len(chunks) == 2


def test_decode_message_handles_raw_and_compressed_messages():
    from types import SimpleNamespace

    raw = SimpleNamespace(encoding="mono8", height=2, width=2, step=2, data=bytes([0, 1, 2, 3]),
                          is_bigendian=0)
    assert decode_message(raw)[1, 1].tolist() == [3, 3, 3]
    ok, png = cv2.imencode(".png", np.full((3, 5, 3), 7, np.uint8))
    compressed = SimpleNamespace(format="png", data=png.tobytes())
    assert decode_message(compressed).shape == (3, 5, 3)
