"""The frame gate: camera messages in, RGB frames grouped into chunks out, without ROS.

Two halves, both free of rclpy so that the node, offline tools (rosbags) and tests share them:

- decode_raw / decode_compressed turn the fields of sensor_msgs/Image and CompressedImage into
  (H, W, 3) uint8 RGB arrays, or raise FrameError saying why the frame is unusable.
- FrameSampler picks frames at a fixed rate by header stamp (never arrival time, so a replayed
  bag gives the same chunks as the live stream), groups them into chunks, and reports time jumps
  (a looped bag, a reset clock, a long outage) so the caller can reset or mark its memory.

Callers ask `wants(stamp)` before decoding, so frames that are not sampled are never decoded.
"""

from __future__ import annotations

import array
import enum
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import cv2
import numpy as np

SUPPORTED_ENCODINGS: tuple[str, ...] = ("rgb8", "bgr8", "rgba8", "bgra8", "mono8")

# Per encoding: bytes per pixel, and the channel slice that reads it as RGB (mono8 is then
# broadcast to three channels).
_LAYOUTS: dict[str, tuple[int, slice]] = {
    "rgb8": (3, slice(0, 3)),
    "bgr8": (3, slice(2, None, -1)),
    "rgba8": (4, slice(0, 3)),
    "bgra8": (4, slice(2, None, -1)),
    "mono8": (1, slice(0, 1)),
}

# ROS encodings with more than 8 bits per channel: depth images, 16-bit colour, float images.
_HIGH_DEPTH = re.compile(r"(mono|rgb|bgr|rgba|bgra)16|(16|32|64)[USF]C\d|bayer_\w+16")

ImageData = bytes | bytearray | memoryview | array.array | np.ndarray


class FrameError(ValueError):
    """A frame that cannot be used; the message says why (logged and counted by callers)."""


def stamp_to_seconds(sec: int, nanosec: int) -> float:
    """A header stamp as float seconds (arithmetic: nanosec may have fewer than 9 digits)."""
    return sec + nanosec * 1e-9


def decode_raw(
    encoding: str,
    height: int,
    width: int,
    step: int,
    data: ImageData,
    is_bigendian: bool = False,
) -> np.ndarray:
    """sensor_msgs/Image fields -> (height, width, 3) uint8 RGB, C-contiguous.

    `data` is read in place (rows may be padded: step >= width * channels); the only copy is the
    final channel conversion, so the result never aliases the message buffer. `is_bigendian` is
    accepted and ignored: byte order does not exist for 8-bit channels.
    """
    if encoding not in _LAYOUTS:
        supported = ", ".join(SUPPORTED_ENCODINGS)
        if _HIGH_DEPTH.fullmatch(encoding):
            raise FrameError(
                f"encoding {encoding!r}: depth / 16-bit / float images are not supported; "
                f"supported encodings: {supported}"
            )
        raise FrameError(f"unknown encoding {encoding!r}; supported encodings: {supported}")
    channels, rgb = _LAYOUTS[encoding]
    if height <= 0 or width <= 0:
        raise FrameError(f"empty image: height={height}, width={width}")
    row_bytes = width * channels
    if step < row_bytes:
        raise FrameError(
            f"step {step} smaller than width*channels = {width}*{channels} = {row_bytes}"
        )
    buffer = _byte_view(data)
    if buffer.size < step * height:
        raise FrameError(
            f"data shorter than step*height: {buffer.size} < {step}*{height} = {step * height}"
        )
    rows = buffer[: step * height].reshape(height, step)[:, :row_bytes]
    pixels = rows.reshape(height, width, channels)  # still a view: strides (step, channels, 1)
    return np.broadcast_to(pixels[..., rgb], (height, width, 3)).copy()


def decode_compressed(format: str, data: ImageData) -> np.ndarray:
    """sensor_msgs/CompressedImage -> (H, W, 3) uint8 RGB.

    The codec is read from the data itself (JPEG, PNG, ...); `format` only serves to refuse
    compressedDepth images, whose PNG carries 16-bit depth behind a private header.
    """
    if "compresseddepth" in format.lower():
        raise FrameError(f"format {format!r}: depth images are not supported")
    buffer = _byte_view(data)
    if buffer.size == 0:
        raise FrameError("empty compressed image data")
    try:
        bgr = cv2.imdecode(buffer, cv2.IMREAD_COLOR)
    except cv2.error as error:
        raise FrameError(f"cannot decode compressed image ({format!r}): {error}") from error
    if bgr is None:
        raise FrameError(f"cannot decode compressed image ({format!r}): corrupt or unknown data")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _byte_view(data: ImageData) -> np.ndarray:
    """(N,) uint8 view of a message buffer, no copy; FrameError if it is not one."""
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as error:
        raise FrameError(f"data is not a contiguous byte buffer: {error}") from error


class TimeEvent(enum.Enum):
    """What a stamp says about the stream's clock, relative to the previous stamp."""

    NONE = "none"
    JUMP_BACK = "jump_back"  # earlier than the last stamp seen (a bag looped, clock reset)
    GAP = "gap"  # later than the last stamp seen by more than max_gap_s


@dataclass(eq=False)
class SampledChunk:
    """frames_per_chunk sampled frames, in stamp order, each (H, W, 3) uint8 RGB.

    Compared by identity (eq=False): field-wise == on arrays has no single truth value.
    """

    index: int  # consecutive since the sampler's start / last reset
    frames: list[np.ndarray] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # header stamps (s)
    times: list[float] = field(default_factory=list)  # stamp - first stamp of the stream (s)


class FrameSampler:
    """Resample a camera stream to `fps` by header stamps (never arrival time) and group frames
    into chunks.

    Per frame: observe(stamp) always, then if wants(stamp): decode, and add(frame, stamp) if the
    decode worked. Sampling slots lie on a grid origin + k / fps; a frame fills the open slot if
    it is no more than tolerance_s early, so timestamp jitter neither drops nor doubles slots.
    """

    def __init__(
        self,
        fps: float = 2.0,
        frames_per_chunk: int = 2,
        max_gap_s: float = 10.0,
        tolerance_s: float = 0.005,
    ) -> None:
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        if frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk must be >= 1, got {frames_per_chunk}")
        if not max_gap_s > 0:
            raise ValueError(f"max_gap_s must be > 0, got {max_gap_s}")
        if not 0 <= tolerance_s < 0.5 / fps:
            raise ValueError(f"tolerance_s must be in [0, half a period {0.5 / fps}), got "
                             f"{tolerance_s}")
        self.fps = fps
        self.frames_per_chunk = frames_per_chunk
        self.max_gap_s = max_gap_s
        self.tolerance_s = tolerance_s
        self.received = 0
        self.sampled = 0
        self.dropped_frames = 0
        self.time_jumps_back = 0
        self.time_gaps = 0
        self.chunks = 0
        self._first: float | None = None  # stream start: stream times count from here
        self._last: float | None = None  # last observed stamp
        self._origin = 0.0  # sampling grid origin: the stream start, or the end of the last gap
        self._next_due = 0.0  # the open slot
        self._index = 0
        self._frames: list[np.ndarray] = []
        self._stamps: list[float] = []

    def observe(self, stamp: float) -> TimeEvent:
        """Note a frame's stamp (call for every frame, first); JUMP_BACK means a new stream."""
        self.received += 1
        last, self._last = self._last, stamp
        if last is None:
            self._start(stamp)
            return TimeEvent.NONE
        if stamp < last - self.tolerance_s:
            self.time_jumps_back += 1
            self._drop_partial()
            self._start(stamp)
            return TimeEvent.JUMP_BACK
        if stamp > last + self.max_gap_s:
            self.time_gaps += 1
            self._drop_partial()
            self._origin = self._next_due = stamp  # same stream time, new sampling grid
            return TimeEvent.GAP
        return TimeEvent.NONE

    def wants(self, stamp: float) -> bool:
        """Whether add() should get this frame; pure, so only wanted frames need decoding."""
        return self._first is None or stamp >= self._next_due - self.tolerance_s

    def add(self, frame: np.ndarray, stamp: float) -> SampledChunk | None:
        """Commit a wanted, decoded (H, W, 3) frame; returns the chunk it completes, if any."""
        if self._first is None:
            raise RuntimeError("FrameSampler.add() before observe(): no stream has started")
        self.sampled += 1
        # Next slot after the one this frame filled, on the grid: a late frame causes no drift,
        # and a slot with no frame is skipped.
        slot = math.floor((stamp - self._origin + self.tolerance_s) * self.fps)
        self._next_due = self._origin + (slot + 1) / self.fps
        if self._frames and frame.shape != self._frames[0].shape:
            self._drop_partial()  # the camera changed resolution mid-chunk
        self._frames.append(frame)
        self._stamps.append(stamp)
        if len(self._frames) < self.frames_per_chunk:
            return None
        chunk = SampledChunk(
            index=self._index,
            frames=self._frames,
            stamps=self._stamps,
            times=[s - self._first for s in self._stamps],
        )
        self._index += 1
        self.chunks += 1
        self._frames, self._stamps = [], []
        return chunk

    def reset(self) -> None:
        """Forget the stream entirely: the next frame starts a new one at chunk index 0."""
        self._drop_partial()
        self._first = self._last = None
        self._index = 0

    @property
    def stream_start(self) -> float | None:
        """Header stamp the current stream's times count from (None before the first frame)."""
        return self._first

    def resume(self, stream_start: float, last_stamp: float, next_index: int) -> None:
        """Continue a saved stream (after a restart): stream times still count from its start,
        chunk indices go on, and stamps before `last_stamp` are a jump back (a new stream)."""
        self._drop_partial()
        self._first, self._last = stream_start, last_stamp
        self._origin = self._next_due = last_stamp
        self._index = next_index

    def _start(self, stamp: float) -> None:
        self._first = self._origin = self._next_due = stamp
        self._index = 0

    def _drop_partial(self) -> None:
        self.dropped_frames += len(self._frames)
        self._frames, self._stamps = [], []


def message_stamp(msg) -> float:
    """Header stamp (s) of a sensor_msgs Image/CompressedImage from rclpy or `rosbags`."""
    return stamp_to_seconds(msg.header.stamp.sec, msg.header.stamp.nanosec)


def decode_message(msg) -> np.ndarray:
    """A sensor_msgs Image or CompressedImage (rclpy or `rosbags` object) -> (H, W, 3) RGB."""
    if hasattr(msg, "format"):
        return decode_compressed(msg.format, msg.data)
    return decode_raw(msg.encoding, msg.height, msg.width, msg.step, msg.data,
                      bool(msg.is_bigendian))


@dataclass(eq=False)
class GateOutcome:
    """What one incoming frame did: a time event, a finished chunk, or why it was dropped."""

    event: TimeEvent = TimeEvent.NONE
    chunk: SampledChunk | None = None
    error: str = ""


class FrameGate:
    """The per-frame path shared by the node, offline runs and benchmarks.

    stamp -> time-jump check -> sampled? -> decode (only then) -> chunk. Decoding failures are
    counted and reported, never raised: a bad frame leaves its sampling slot open.
    """

    def __init__(self, sampler: FrameSampler) -> None:
        self.sampler = sampler
        self.bad_frames = 0
        self.last_error = ""

    def push(self, stamp: float, decode: Callable[[], np.ndarray]) -> GateOutcome:
        outcome = GateOutcome(event=self.sampler.observe(stamp))
        if not self.sampler.wants(stamp):
            return outcome
        try:
            frame = decode()
        except FrameError as error:
            self.bad_frames += 1
            self.last_error = outcome.error = str(error)
            return outcome
        outcome.chunk = self.sampler.add(frame, stamp)
        return outcome
