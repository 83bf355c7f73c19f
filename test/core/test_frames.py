"""The frame gate without ROS: decoding sensor_msgs image fields, and sampling by header stamp."""

from __future__ import annotations

import array
import math
import random
import time

import cv2
import numpy as np
import pytest
from engine_helpers import corrupted_jpeg
from hypothesis import given, settings
from hypothesis import strategies as st

from deltas_ros.core.decode import (
    SUPPORTED_ENCODINGS,
    FrameError,
    decode_compressed,
    decode_message,
    decode_raw,
    message_stamp,
    stamp_to_seconds,
)
from deltas_ros.core.frames import FrameGate, FrameSampler, SampledChunk, TimeEvent

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


def test_small_backward_jitter_is_not_a_jump():
    sampler = FrameSampler(tolerance_s=0.005)
    sampler.add(frame_for(BASE), BASE)
    assert sampler.observe(BASE - 0.003) is TimeEvent.NONE
    assert sampler.observe(BASE - 0.010) is TimeEvent.JUMP_BACK


def test_forward_step_below_max_gap_is_not_a_gap():
    sampler = FrameSampler(max_gap_s=10.0)
    sampler.add(frame_for(BASE), BASE)
    assert sampler.observe(BASE + 9.9) is TimeEvent.NONE
    assert sampler.observe(BASE + 20.0) is TimeEvent.GAP


def test_observe_only_classifies():
    sampler = FrameSampler()
    sampler.add(frame_for(BASE), BASE)
    for stamp in (BASE - 1.0, BASE + 20.0, BASE + 0.1):
        sampler.observe(stamp)
    assert sampler.observe(BASE - 1.0) is TimeEvent.JUMP_BACK  # the clock did not move
    assert (sampler.received, sampler.sampled, sampler.time_jumps_back) == (4, 1, 0)


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


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"fps": 0.0}, "fps"),
        ({"fps": -2.0}, "fps"),
        ({"frames_per_chunk": 0}, "frames_per_chunk"),
        ({"max_gap_s": 0.0}, "max_gap_s"),
        ({"tolerance_s": -0.001}, "tolerance_s"),
        ({"tolerance_s": 0.25}, "tolerance_s"),  # half of a 0.5 s period
        ({"frames_per_chunk": 1}, "frames_per_chunk"),
        ({"confirm_frames": 1}, "confirm_frames"),
        ({"confirm_s": -0.1}, "confirm_s"),
        ({"confirm_s": math.inf}, "confirm_s"),
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
        chunks += outcome.chunks
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


# --- the stream clock rule (module docstring of deltas_ros.core.frames) -------------------------


def raw_rgb(stamp: float, encoding: str = "rgb8", height: int = 2, width: int = 2):
    """A decode callable for a raw frame whose pixels tell its stamp."""
    data = frame_for(stamp, (height, width, 3)).tobytes()
    return lambda: decode_raw(encoding, height, width, width * 3, data)


def unset_stamp() -> float:
    """What an Image whose header stamp was never set gives."""
    from types import SimpleNamespace

    stamp = SimpleNamespace(sec=0, nanosec=0)
    return message_stamp(SimpleNamespace(header=SimpleNamespace(stamp=stamp)))


def feed(gate: FrameGate, frames, arrivals=None) -> tuple[list[SampledChunk], list[TimeEvent]]:
    """Push (stamp, decode) pairs, arriving at `arrivals` (None: at their stamps, as offline);
    the chunks and the time events that came out."""
    chunks, events = [], []
    for k, (stamp, decode) in enumerate(frames):
        outcome = gate.push(stamp, decode, None if arrivals is None else arrivals[k])
        events.append(outcome.event)
        chunks += outcome.chunks
    return chunks, events


def same_chunks(a: list[SampledChunk], b: list[SampledChunk]) -> bool:
    return [(c.index, c.stamps, c.times) for c in a] == [(c.index, c.stamps, c.times) for c in b] \
        and all(np.array_equal(x, y) for ca, cb in zip(a, b) for x, y in zip(ca.frames, cb.frames))


def empty_frame():
    return decode_raw("rgb8", 0, 0, 0, b"")


def depth_frame():
    return decode_raw("16UC1", 2, 2, 4, bytes(8))


def unknown_encoding():
    return decode_raw("yuv422_weird", 2, 2, 4, bytes(8))


# Each attack: frames (stamp offset from the attack point, decode) slipped into a clean stream.
ATTACKS = {
    "stamp 0, unknown encoding": [(None, unknown_encoding)],
    "good frame stamped 0": [(None, "good")],
    "16UC1 stamped 1 s back": [(-1.0, depth_frame)],
    "empty frame stamped in 2038": [(2_145_916_800.0 - BASE, empty_frame)],
    "good frame stamped +20 s": [(20.0, "good")],
    "two good frames stamped 1 s back": [(-1.0, "good"), (-0.9, "good")],
    "three undecodable frames stamped 5 s back": [(-5.0, depth_frame), (-4.9, depth_frame),
                                                  (-4.8, depth_frame)],
}


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("where", [14, 15, 16])  # before, at and after a sampling slot
def test_one_bad_stamp_never_moves_the_clock(attack, where):
    stamps = camera(3.0)
    clean_gate = FrameGate(FrameSampler())
    clean, _ = feed(clean_gate, [(s, raw_rgb(s)) for s in stamps])
    attack_point = stamps[where]
    injected = []
    for offset, decode in ATTACKS[attack]:
        stamp = unset_stamp() if offset is None else attack_point + offset
        injected.append((stamp, raw_rgb(attack_point) if decode == "good" else decode))
    frames = [(s, raw_rgb(s)) for s in stamps]
    gate = FrameGate(FrameSampler())

    chunks, events = feed(gate, frames[:where] + injected + frames[where:])

    assert same_chunks(chunks, clean) and len(chunks) == 3
    assert set(events) == {TimeEvent.NONE}
    sampler = gate.sampler
    assert (sampler.time_jumps_back, sampler.time_gaps, sampler.dropped_frames) == (0, 0, 0)
    assert gate.bad_frames == len(injected) and gate.last_error  # counted, with a reason
    assert gate.bad_stamps == sum(offset is None for offset, _ in ATTACKS[attack])


def test_a_zero_stamp_never_starts_the_stream():
    gate = FrameGate(FrameSampler())
    chunks, _ = feed(gate, [(unset_stamp(), raw_rgb(BASE))]
                     + [(s, raw_rgb(s)) for s in camera(1.0)])
    assert chunks[0].times == pytest.approx([0.0, 0.5], abs=1e-6)  # not ~1.7e9 s
    assert gate.bad_stamps == 1 and "unset header stamp" in gate.last_error
    feed(gate, [(-5.0, raw_rgb(BASE))])
    assert gate.bad_stamps == 2 and "stamp -5.0" in gate.last_error


def test_a_time_of_zero_that_is_no_header_is_a_time():
    """A video file's frames are at index / fps: the first one at 0.0 s."""
    gate = FrameGate(FrameSampler())
    chunks, _ = feed(gate, [(i / 10, raw_rgb(i / 10)) for i in range(10)])
    assert chunks[0].stamps == [0.0, 0.5] and gate.bad_stamps == 0


def test_a_jump_back_needs_a_second_of_frames_and_the_next_pass_repeats_the_first():
    gate = FrameGate(FrameSampler())
    stamps = camera(3.0)

    first, events_first = feed(gate, [(s, raw_rgb(s)) for s in stamps])
    second, events = feed(gate, [(s, raw_rgb(s)) for s in stamps])  # the bag looped

    assert events.index(TimeEvent.JUMP_BACK) == 30  # 1 s of its frames (30 fps) after the first
    assert set(events_first + events[:30] + events[31:]) == {TimeEvent.NONE}
    assert same_chunks(second, first) and [c.index for c in second] == [0, 1, 2]
    sampler = gate.sampler
    assert (sampler.time_jumps_back, sampler.stamp_outliers, gate.bad_frames) == (1, 0, 0)


def test_a_gap_needs_a_second_of_frames_and_keeps_stream_time():
    gate = FrameGate(FrameSampler(max_gap_s=10.0))
    before, _ = feed(gate, [(s, raw_rgb(s)) for s in camera(1.2)])  # chunk 0 and a partial one
    resume = BASE + 61.3  # off the old 0.5 s grid

    after, events = feed(gate, [(s, raw_rgb(s)) for s in camera(1.5, start=resume)])

    assert events.index(TimeEvent.GAP) == 30 and events.count(TimeEvent.GAP) == 1
    assert [c.index for c in before + after] == [0, 1]  # same stream: indices continue
    assert after[0].stamps == pytest.approx([resume, resume + 0.5], abs=1e-6)  # new grid
    assert after[0].times == pytest.approx([61.3, 61.8], abs=1e-6)  # the gap shows in time
    assert (gate.sampler.time_gaps, gate.sampler.dropped_frames) == (1, 1)


def test_a_slow_camera_confirms_with_the_held_frames_sampled():
    """At the sampling rate itself every evidence frame is sampled: none of them is lost."""
    gate = FrameGate(FrameSampler(fps=2.0, frames_per_chunk=2))
    feed(gate, [(s, raw_rgb(s)) for s in camera(2.0, rate=2.0)])
    restart = BASE - 50.0
    chunks, events = feed(gate, [(s, raw_rgb(s)) for s in camera(2.0, rate=2.0, start=restart)])
    assert events[2] is TimeEvent.JUMP_BACK
    assert [c.stamps for c in chunks] == [[restart, restart + 0.5], [restart + 1.0, restart + 1.5]]


def test_interleaved_timelines_never_confirm_and_are_counted():
    gate = FrameGate(FrameSampler())
    stamps = camera(3.0)
    other = [s - 100.0 for s in stamps]
    clean, _ = feed(FrameGate(FrameSampler()), [(s, raw_rgb(s)) for s in stamps])

    frames = [pair for s, o in zip(stamps, other) for pair in ((s, raw_rgb(s)), (o, raw_rgb(o)))]
    chunks, events = feed(gate, frames)

    assert same_chunks(chunks, clean) and set(events) == {TimeEvent.NONE}
    assert gate.sampler.stamp_outliers == len(other) - 1  # the last one is still held
    assert "off the stream clock" in gate.last_error


def live_with_burst(burst_offset: float) -> tuple[list, list[float]]:
    """A live 30 fps camera for 4 s (arriving at its stamps' pace) and, 2 s in, three frames
    stamped `burst_offset` s away (0, +0.5, +1.0 s apart), all sent within 15 ms."""
    stamps = camera(4.0)
    frames = [(s, raw_rgb(s)) for s in stamps]
    arrivals = [s - BASE for s in stamps]
    at = 60
    burst = [BASE + 2.0 + burst_offset + d for d in (0.0, 0.5, 1.0)]
    frames[at:at] = [(b, raw_rgb(b)) for b in burst]
    arrivals[at:at] = [arrivals[at - 1] + 0.005 * (k + 1) for k in range(3)]
    return frames, arrivals


@pytest.mark.parametrize("offset", [1e7, -100.0])
def test_a_burst_beside_the_live_camera_is_dropped_and_counted(offset):
    """Three messages in 15 ms are three frames but not a timeline: the live camera's next frame
    ends them, the stream goes on as if they never came."""
    frames, arrivals = live_with_burst(offset)
    clean, _ = feed(FrameGate(FrameSampler()), [f for f in frames if abs(f[0] - BASE) < 10],
                    [a for f, a in zip(frames, arrivals) if abs(f[0] - BASE) < 10])
    gate = FrameGate(FrameSampler())

    chunks, events = feed(gate, frames, arrivals)

    assert same_chunks(chunks, clean) and set(events) == {TimeEvent.NONE}
    assert gate.sampler.stamp_outliers == 3 and gate.bad_frames == 3
    assert (gate.sampler.time_jumps_back, gate.sampler.time_gaps) == (0, 0)


def test_a_burst_alone_still_needs_a_second_of_arrival_time():
    """With the camera silent, evidence sent all at once confirms nothing however many frames
    it holds; the same frames spread over a second do."""
    gate = FrameGate(FrameSampler())
    feed(gate, [(s, raw_rgb(s)) for s in camera(1.0)], [0.0] * 30)
    future = camera(2.0, start=BASE + 1000.0)
    _, events = feed(gate, [(s, raw_rgb(s)) for s in future], [1.0 + k * 1e-4 for k in range(60)])
    assert set(events) == {TimeEvent.NONE}
    _, events = feed(gate, [(future[-1] + 0.5, raw_rgb(future[-1]))], [2.0])
    assert events == [TimeEvent.GAP]


def test_a_camera_that_restarts_its_clock_is_followed_from_its_first_frame():
    """A driver restarted: stamps start again near zero (no time source yet), frames keep
    arriving at 30 fps. After a second of them the memory's new stream starts at the first."""
    gate = FrameGate(FrameSampler())
    feed(gate, [(s, raw_rgb(s)) for s in camera(3.0)], [k / 30 for k in range(90)])
    restarted = camera(3.0, start=12.0)
    chunks, events = feed(gate, [(s, raw_rgb(s)) for s in restarted],
                          [3.2 + k / 30 for k in range(90)])
    assert events.count(TimeEvent.JUMP_BACK) == 1 and events.index(TimeEvent.JUMP_BACK) == 30
    assert [c.index for c in chunks] == [0, 1, 2]
    assert chunks[0].stamps == pytest.approx([12.0, 12.5]) and chunks[0].times[0] == 0.0


def test_a_reset_simulation_clock_is_followed():
    """use_sim_time and a simulator restarted: the /clock-stamped frames go back to 0.1 s."""
    gate = FrameGate(FrameSampler(fps=2.0))
    feed(gate, [(s, raw_rgb(s)) for s in camera(5.0, rate=10.0, start=300.0)],
         [k / 10 for k in range(50)])
    chunks, events = feed(gate, [(s, raw_rgb(s)) for s in camera(3.0, rate=10.0, start=0.1)],
                          [5.0 + k / 10 for k in range(30)])
    assert events.count(TimeEvent.JUMP_BACK) == 1
    assert chunks[0].stamps == pytest.approx([0.1, 0.6]) and gate.sampler.stamp_outliers == 0


def test_a_fast_replay_sheds_the_oldest_held_frames_and_counts_them():
    """A bag looping at 10x real time: a second of arrival holds 10 s of stamps; the evidence
    keeps the newest 4 chunks' frames, and the frames it shed are counted as dropped."""
    gate = FrameGate(FrameSampler())
    stamps = camera(12.0)
    feed(gate, [(s, raw_rgb(s)) for s in stamps], [(s - BASE) / 10 for s in stamps])
    chunks, events = feed(gate, [(s, raw_rgb(s)) for s in stamps],
                          [2.0 + (s - BASE) / 10 for s in stamps])
    confirmed = events.index(TimeEvent.JUMP_BACK)
    assert confirmed == 300  # 1 s of arrival = 10 s of stamps at 30 fps
    assert gate.sampler.dropped_frames == 21 - 8  # 0.0 .. 10.0 s held at 2 fps, 8 kept
    assert chunks[0].stamps == pytest.approx([BASE + 6.5, BASE + 7.0])
    assert chunks[0].times == [0.0, 0.5]  # the new stream starts where its held frames do


def test_repeated_stamps_are_no_evidence():
    gate = FrameGate(FrameSampler())
    feed(gate, [(s, raw_rgb(s)) for s in camera(1.0)])
    _, events = feed(gate, [(BASE - 5.0, raw_rgb(BASE))] * 5)  # one frame re-sent
    assert set(events) == {TimeEvent.NONE} and gate.sampler.time_jumps_back == 0


def test_evidence_more_than_max_gap_apart_does_not_confirm():
    gate = FrameGate(FrameSampler(max_gap_s=10.0))
    feed(gate, [(s, raw_rgb(s)) for s in camera(1.0)])
    late = [BASE - 1000.0 + 11.0 * k for k in range(4)]  # each 11 s after the previous one
    _, events = feed(gate, [(s, raw_rgb(s)) for s in late])
    assert set(events) == {TimeEvent.NONE} and gate.sampler.stamp_outliers == 3


def test_an_absurd_first_frame_gives_way_to_the_real_timeline():
    gate = FrameGate(FrameSampler())
    absurd = 2_145_916_800.0
    chunks, events = feed(gate, [(absurd, raw_rgb(absurd))]
                          + [(s, raw_rgb(s)) for s in camera(2.0)])
    assert events.count(TimeEvent.JUMP_BACK) == 1
    assert [c.index for c in chunks] == [0, 1]
    assert chunks[0].stamps[0] == BASE and chunks[0].times == pytest.approx([0.0, 0.5], abs=1e-6)


def test_reset_and_resume_drop_held_evidence():
    gate = FrameGate(FrameSampler())
    feed(gate, [(s, raw_rgb(s)) for s in camera(1.0)])
    feed(gate, [(BASE - 9.0, raw_rgb(BASE)), (BASE - 8.9, raw_rgb(BASE))])
    gate.sampler.reset()
    assert gate.sampler.stamp_outliers == 2
    feed(gate, [(BASE - 9.0, raw_rgb(BASE)), (BASE - 8.9, raw_rgb(BASE))])
    gate.sampler.resume(BASE, BASE + 0.5, 1)
    assert gate.sampler.stamp_outliers == 2  # those two started the stream after the reset


def test_only_evidence_and_sampled_frames_are_decoded():
    gate = FrameGate(FrameSampler())
    decoded = []

    def counting(stamp: float):
        def decode() -> np.ndarray:
            decoded.append(round(stamp - BASE, 3))
            return frame_for(stamp)
        return decode

    feed(gate, [(s, counting(s)) for s in camera(1.2)])
    feed(gate, [(s, counting(s)) for s in camera(1.2, start=BASE - 10.0)])  # a jump back
    assert decoded == [0.0, 0.5, 1.0, -10.0, -9.5, -9.0]  # the new timeline's samples only


def test_a_frame_beyond_the_size_limits_is_refused_at_the_gate():
    """Any decoder (offline video, benchmarks): the gate checks what it got."""
    gate = FrameGate(FrameSampler())
    outcome = gate.push(BASE, lambda: np.zeros((1, 1000, 3), np.uint8))
    assert "elongated" in outcome.error and gate.bad_frames == 1
    assert gate.sampler.stream_start is None  # it did not start the stream


# --- size limits before decoding --------------------------------------------------------------


def test_raw_frames_beyond_the_limits_are_refused_from_their_header():
    from deltas_ros.core.decode import MAX_FRAME_PIXELS

    with pytest.raises(FrameError, match="elongated"):
        decode_raw("mono8", 1, 1_000_000, 1_000_000, bytes(1_000_000))
    side = int(MAX_FRAME_PIXELS**0.5) + 1
    with pytest.raises(FrameError, match="larger than the limit"):
        decode_raw("rgb8", side, side, side * 3, b"")  # refused before the data is looked at


def _png_header(width: int, height: int) -> bytes:
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    body = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + body
            + struct.pack(">I", zlib.crc32(body)))


def test_a_png_bomb_is_refused_before_decoding(monkeypatch):
    def decoded(*args):
        raise AssertionError("decoded before the size check")

    monkeypatch.setattr(cv2, "imdecode", decoded)
    with pytest.raises(FrameError, match="30000x30000 pixels is larger than the limit"):
        decode_compressed("png", _png_header(30000, 30000) + bytes(100_000))
    with pytest.raises(FrameError, match="elongated"):
        decode_compressed("png", _png_header(1_000_000, 1))


@pytest.mark.parametrize("progressive", [0, 1])
@pytest.mark.parametrize(("height", "width"), [(1, 1), (17, 300), (480, 640), (1000, 8)])
def test_compressed_size_reads_jpeg_and_png_headers(height, width, progressive):
    from deltas_ros.core.decode import compressed_size

    image = np.random.default_rng(0).integers(0, 255, (height, width, 3), np.uint8)
    ok, jpeg = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_PROGRESSIVE, progressive])
    assert ok and compressed_size(jpeg.ravel()) == (height, width)
    assert compressed_size(np.frombuffer(_encoded(".png", image), np.uint8)) == (height, width)


def test_a_truncated_jpeg_is_refused_whatever_the_opencv_build():
    """OpenCV 4 builds returned truncated JPEGs filled with grey; the end marker is checked."""
    image = _smooth_rgb(240, 320)
    data = _encoded(".jpg", image)[:-2000]
    with pytest.raises(FrameError, match="truncated"):
        decode_compressed("jpeg", data)
    padded = _encoded(".jpg", image) + bytes(16)  # zero padding after the end marker is fine
    assert decode_compressed("jpeg", padded).shape == (240, 320, 3)


def test_other_codecs_are_refused_with_the_reason():
    with pytest.raises(FrameError, match="not PNG or JPEG"):
        decode_compressed("bmp", _encoded(".bmp", _smooth_rgb()))


def test_the_aspect_limit_is_the_models():
    """The gate refuses exactly the frames smart_resize (the worker) would fail on."""
    from deltas_ros.core.chunks import smart_resize
    from deltas_ros.core.decode import MAX_ASPECT_RATIO, check_frame_size

    for height, width in [(1, MAX_ASPECT_RATIO), (3, 3 * MAX_ASPECT_RATIO), (MAX_ASPECT_RATIO, 1)]:
        check_frame_size(height, width)
        smart_resize(2, height, width, 32, 32 * 32, 4096)
    for height, width in [(1, MAX_ASPECT_RATIO + 1), (1, 1_000_000)]:
        with pytest.raises(FrameError, match="elongated"):
            check_frame_size(height, width)
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(2, height, width, 32, 32 * 32, 4096)


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, 2000), flips=st.lists(st.tuples(st.integers(0, 2000),
                                                           st.integers(0, 255)), max_size=4))
def test_jpeg_header_fuzz_only_raises_frame_error(cut, flips):
    data = bytearray(_encoded(".jpg", _smooth_rgb(16, 24)))
    for at, value in flips:
        data[at % len(data)] = value
    try:
        frame = decode_compressed("jpeg", bytes(data[: max(cut, 2)] if cut < len(data) else data))
    except FrameError:
        return
    assert frame.ndim == 3 and frame.shape[2] == 3


def test_a_jpeg_libjpeg_reports_corrupt_is_refused():
    """A damaged byte that OpenCV's decoder only prints a warning about ("Corrupt JPEG data")."""
    ok, encoded = cv2.imencode(".jpg", cv2.GaussianBlur(
        np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8), (9, 9), 3))
    damaged = corrupted_jpeg(encoded.tobytes())
    assert cv2.imdecode(np.frombuffer(damaged, np.uint8), cv2.IMREAD_COLOR) is not None
    with pytest.raises(FrameError, match="corrupt JPEG.*Corrupt JPEG data"):
        decode_compressed("jpeg", damaged)
    good = decode_compressed("jpeg", encoded.tobytes())  # the same pixels OpenCV gives
    assert np.array_equal(good, cv2.cvtColor(cv2.imdecode(encoded, cv2.IMREAD_COLOR),
                                             cv2.COLOR_BGR2RGB))
