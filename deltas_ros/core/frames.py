"""The frame gate: decoded camera frames grouped into chunks, without ROS.

FrameSampler picks frames at a fixed rate by header stamp (never arrival time, so a replayed bag
gives the same chunks as the live stream) and groups them into chunks; FrameGate runs each
message through the stream clock rule below, decoding (decode.py) only what it must. Both are
free of rclpy so that the node, offline tools (rosbags) and tests share them.

The stream clock rule (why: one message must never damage the memory, and a looped bag, a
restarted camera or a long outage must still be followed):

1. The clock is the stamp of the last *accepted* frame: a frame that was decoded and added to a
   chunk. A frame that fails to decode, is not sampled, or is refused changes nothing.
2. A header stamp of 0 (sec and nanosec both 0) is an unset header, not a time: message_stamp
   gives NaN (UNSET_STAMP) and the gate drops and counts the frame (`bad_stamps`, and as a bad
   frame), as it does a negative stamp. Falling back to arrival time would mix two clocks and
   break "a replayed bag gives the same chunks". (Stamps that are not headers may be 0: a video
   file's first frame is at 0.0 s.) Absurd stamps that are set (2038, a stamp from another
   clock) are handled by rule 3: alone they never move the clock.
3. A frame whose stamp disagrees with the clock - earlier by more than `tolerance_s` (a jump
   back) or later by more than `max_gap_s` (a jump forward) - is evidence for a new timeline,
   not a new timeline. Evidence is a run of frames with stamps strictly increasing, each within
   `max_gap_s` of the previous one. It confirms the new timeline once it has lasted
   `confirm_s` of ARRIVAL time (the node's monotonic clock when each message came; offline,
   where a recording is read as fast as it goes, the stamps themselves) and holds at least
   `confirm_frames` (3) frames. Then a jump back starts a new stream (the caller resets its
   memory) and a jump forward opens a new segment (memory kept, the gap shows in stream time),
   and the held frames become the first frames of that timeline, so a looped bag's second pass
   gives the same chunks as its first.
4. A frame that agrees with the clock ends any evidence being gathered: the held frames are
   dropped and counted (`stamp_outliers`, and as bad frames). The current timeline wins, so
   doubtful evidence keeps the memory rather than wiping it.

Why arrival time and not a count of frames: a count measures messages, and any client can send
three messages in a millisecond while the real camera goes on; a second of arrival time with no
frame of the current clock in it is what a looped bag, a restarted camera or a reset simulation
clock show and a burst does not. The cost on a real jump is `confirm_s` of video, which is held,
not lost.

Held frames are bounded: the evidence keeps only the frames the new timeline would sample (a grid
at `fps` from its first stamp; only those are decoded), at most `4 * frames_per_chunk` of them;
beyond that the oldest is dropped and counted in `dropped_frames` (a replay much faster than
real time loses the start of its new pass, never more than that bound holds).

Decoding cost: frames that agree with the clock and are not due for sampling cost two stamp
comparisons and are never decoded. A frame of the evidence is decoded when the new timeline
would sample it (an undecodable one is no evidence), so at most one decode per sampling slot.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .config import StreamConfig
from .decode import FrameError, check_frame_size


class TimeEvent(enum.Enum):
    """What a stamp says about the stream's clock, relative to the last accepted stamp."""

    NONE = "none"
    JUMP_BACK = "jump_back"  # earlier than the clock (a bag looped, clock reset)
    GAP = "gap"  # later than the clock by more than max_gap_s


# A new timeline is confirmed by `timeline_confirm_s` of arrival time and at least
# CONFIRM_FRAMES frames (module docstring, rule 3).
CONFIRM_FRAMES = 3
# Held evidence frames, in chunks: a replay at up to 4x real time keeps its new pass whole.
EVIDENCE_CHUNKS = 4


@dataclass(eq=False)
class SampledChunk:
    """frames_per_chunk sampled frames, in stamp order, each (H, W, 3) uint8 RGB.

    Compared by identity (eq=False): field-wise == on arrays has no single truth value.
    """

    index: int  # consecutive since the sampler's start / last reset
    frames: list[np.ndarray] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # header stamps (s)
    times: list[float] = field(default_factory=list)  # stamp - first stamp of the stream (s)


@dataclass(eq=False)
class PendingTimeline:
    """Frames of a timeline other than the clock's, gathered until they confirm it (rule 3).

    `held` are the decoded frames the new timeline would sample, on a grid at `fps` from the
    first stamp (at most `limit`; beyond, the oldest goes); `frames` counts every frame of it.
    """

    first_arrival: float
    last_stamp: float
    grid: float  # the first stamp: the new timeline's sampling grid starts here
    due: float  # the next stamp the new timeline would sample
    held: list[tuple[np.ndarray, float]] = field(default_factory=list)
    frames: int = 0
    shed: int = 0  # held frames dropped for the bound


class FrameSampler:
    """Resample a camera stream to `fps` by header stamps (never arrival time), group frames into
    chunks, and keep the stream clock by the rule in the module docstring.

    Per frame (FrameGate does this): observe(stamp) classifies it against the clock without
    changing anything. NONE: if wants(stamp), decode and add(frame, stamp). JUMP_BACK / GAP:
    if evidence_wants(stamp), decode; then propose(frame or None, stamp, arrival), which gathers
    the evidence and follows the new timeline once it is confirmed. Sampling slots lie on a grid
    origin + k / fps; a frame fills the open slot if it is no more than tolerance_s early, so
    timestamp jitter neither drops nor doubles slots.
    """

    def __init__(
        self,
        fps: float = StreamConfig.fps,
        frames_per_chunk: int = StreamConfig.frames_per_chunk,
        max_gap_s: float = StreamConfig.max_gap_s,
        tolerance_s: float = StreamConfig.tolerance_s,
        confirm_s: float = StreamConfig.timeline_confirm_s,
        confirm_frames: int = CONFIRM_FRAMES,
    ) -> None:
        if not fps > 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        if frames_per_chunk < 2:  # the model takes frames in pairs (temporal patches)
            raise ValueError(f"frames_per_chunk must be >= 2, got {frames_per_chunk}")
        if not max_gap_s > 0:
            raise ValueError(f"max_gap_s must be > 0, got {max_gap_s}")
        if not 0 <= tolerance_s < 0.5 / fps:
            raise ValueError(f"tolerance_s must be in [0, half a period {0.5 / fps}), got "
                             f"{tolerance_s}")
        if not 0 <= confirm_s < math.inf:
            raise ValueError(f"confirm_s must be finite and >= 0, got {confirm_s}")
        if confirm_frames < 2:  # one frame never moves the clock
            raise ValueError(f"confirm_frames must be >= 2, got {confirm_frames}")
        self.fps, self.frames_per_chunk = fps, frames_per_chunk
        self.max_gap_s, self.tolerance_s = max_gap_s, tolerance_s
        self.confirm_s, self.confirm_frames = confirm_s, confirm_frames  # rule 3
        self.received = 0
        self.sampled = 0
        self.dropped_frames = 0
        self.time_jumps_back = 0
        self.time_gaps = 0
        self.stamp_outliers = 0  # frames of evidence for a new timeline that never came
        self.chunks = 0
        self._first: float | None = None  # stream start: stream times count from here
        self._last: float | None = None  # the clock: latest accepted stamp
        self._origin = 0.0  # sampling grid origin: the stream start, or the end of the last gap
        self._next_due = 0.0  # the open slot
        self._index = 0
        self._frames: list[np.ndarray] = []
        self._stamps: list[float] = []
        self._evidence: PendingTimeline | None = None

    def observe(self, stamp: float) -> TimeEvent:
        """Count a frame and say how its stamp relates to the clock; changes nothing else."""
        self.received += 1
        if self._last is None:
            return TimeEvent.NONE
        if stamp < self._last - self.tolerance_s:
            return TimeEvent.JUMP_BACK
        if stamp > self._last + self.max_gap_s:
            return TimeEvent.GAP
        return TimeEvent.NONE

    def wants(self, stamp: float) -> bool:
        """Whether add() should get this frame; pure, so only wanted frames need decoding."""
        return self._first is None or stamp >= self._next_due - self.tolerance_s

    def evidence_wants(self, stamp: float) -> bool:
        """Whether propose() needs this off-clock frame decoded: it starts evidence, or the new
        timeline would sample it. Pure, as wants()."""
        evidence = self._evidence
        return not self._continues(evidence, stamp) or stamp >= evidence.due - self.tolerance_s

    def add(self, frame: np.ndarray, stamp: float) -> SampledChunk | None:
        """Commit a wanted, decoded (H, W, 3) frame that agrees with the clock (observe() said
        NONE); it ends any evidence held for another timeline. Returns the chunk it completes."""
        self.dismiss_evidence()
        return self._add(frame, stamp)

    def propose(self, frame: np.ndarray | None, stamp: float, arrival: float
                ) -> tuple[TimeEvent, list[SampledChunk]]:
        """Gather a frame that disagrees with the clock as evidence for a new timeline.

        frame: decoded when evidence_wants(stamp), else None. arrival: when it came (seconds of
        a monotonic clock). Returns (NONE, []) until the evidence confirms the timeline; then
        (JUMP_BACK or GAP, the chunks the held frames complete on it).
        """
        evidence = self._evidence
        if not self._continues(evidence, stamp):
            self.dismiss_evidence()  # another timeline again: start over from this frame
            evidence = self._evidence = PendingTimeline(arrival, stamp, grid=stamp, due=stamp)
        evidence.frames += 1
        evidence.last_stamp = stamp
        if frame is not None:
            slot = math.floor((stamp - evidence.grid + self.tolerance_s) * self.fps)
            evidence.due = evidence.grid + (slot + 1) / self.fps
            evidence.held.append((frame, stamp))
            if len(evidence.held) > EVIDENCE_CHUNKS * self.frames_per_chunk:
                del evidence.held[0]
                evidence.shed += 1
        if evidence.frames < self.confirm_frames or arrival - evidence.first_arrival \
                < self.confirm_s:
            return TimeEvent.NONE, []
        return self._follow(evidence)

    def _continues(self, evidence: PendingTimeline | None, stamp: float) -> bool:
        """Whether `stamp` carries `evidence` on: later than its last frame, within max_gap_s."""
        return evidence is not None and \
            evidence.last_stamp < stamp <= evidence.last_stamp + self.max_gap_s

    def _follow(self, evidence: PendingTimeline) -> tuple[TimeEvent, list[SampledChunk]]:
        """The evidence is confirmed: move the clock to its timeline, its frames first."""
        self._evidence = None
        self.dropped_frames += evidence.shed
        start = evidence.held[0][1]
        self._drop_partial()
        if self._last is not None and start < self._last - self.tolerance_s:
            event = TimeEvent.JUMP_BACK
            self.time_jumps_back += 1
            self._start(start)
        else:
            event = TimeEvent.GAP
            self.time_gaps += 1
            self._origin = self._next_due = start  # same stream time, new sampling grid
        chunks = [chunk for frame, stamp in evidence.held
                  if self.wants(stamp) and (chunk := self._add(frame, stamp)) is not None]
        return event, chunks

    def dismiss_evidence(self) -> int:
        """Drop the evidence gathered for a new timeline (counted in stamp_outliers); how many
        frames it had."""
        count = self._evidence.frames if self._evidence is not None else 0
        self.stamp_outliers += count
        self._evidence = None
        return count

    def reset(self) -> None:
        """Forget the stream entirely: the next frame starts a new one at chunk index 0."""
        self._drop_partial()
        self.dismiss_evidence()
        self._first = self._last = None
        self._index = 0

    @property
    def stream_start(self) -> float | None:
        """Header stamp the current stream's times count from (None before the first frame)."""
        return self._first

    @property
    def next_index(self) -> int:
        """Index the next chunk of the current stream gets."""
        return self._index

    def resume(self, stream_start: float, last_stamp: float, next_index: int) -> None:
        """Continue a saved stream (after a restart): stream times still count from its start,
        chunk indices go on, and the clock stands at `last_stamp`."""
        self._drop_partial()
        self.dismiss_evidence()
        self._first, self._last = stream_start, last_stamp
        self._origin = self._next_due = last_stamp
        self._index = next_index

    def _add(self, frame: np.ndarray, stamp: float) -> SampledChunk | None:
        if self._first is None:
            self._start(stamp)
        self.sampled += 1
        self._last = stamp if self._last is None else max(self._last, stamp)
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

    def _start(self, stamp: float) -> None:
        self._first = self._last = self._origin = self._next_due = stamp
        self._index = 0

    def _drop_partial(self) -> None:
        self.dropped_frames += len(self._frames)
        self._frames, self._stamps = [], []



@dataclass(eq=False)
class GateOutcome:
    """What one incoming frame did: a time event, the chunks it finished (one at most, except
    when a confirmed timeline's held frames complete several), or why it was dropped."""

    event: TimeEvent = TimeEvent.NONE
    chunks: list[SampledChunk] = field(default_factory=list)
    error: str = ""


class FrameGate:
    """The per-frame path shared by the node, offline runs and benchmarks.

    stamp set? -> agrees with the clock? -> sampled? -> decode (only then) -> chunk; a stamp off
    the clock -> decode if the new timeline would sample it -> evidence (module docstring).
    Failures are counted and reported, never raised: a bad frame leaves its sampling slot open
    and the clock where it was.
    """

    def __init__(self, sampler: FrameSampler) -> None:
        self.sampler = sampler
        self.bad_frames = 0  # refused: undecodable, unset stamp, or unconfirmed stamp outlier
        self.bad_stamps = 0  # of which: unset (NaN from message_stamp) or negative stamps
        self.last_error = ""

    def push(self, stamp: float, decode: Callable[[], np.ndarray],
             arrival: float | None = None) -> GateOutcome:
        """One frame. arrival: when it came, in seconds of a monotonic clock (the node:
        time.monotonic()); None takes the stamp itself, for a recording read faster than real
        time, whose stamps are the only clock it has."""
        sampler = self.sampler
        outcome = GateOutcome()
        event = sampler.observe(stamp)
        outliers = sampler.stamp_outliers
        if not 0 <= stamp < math.inf:  # NaN: an unset header stamp
            self.bad_stamps += 1
            what = "unset header stamp (0)" if math.isnan(stamp) else f"stamp {stamp}"
            self._refuse(outcome, f"{what}: frame dropped", 1)
        elif event is TimeEvent.NONE:
            sampler.dismiss_evidence()  # agrees with the clock: held evidence was a stray
            if sampler.wants(stamp) and (frame := self._decode(decode, outcome)) is not None:
                outcome.chunks = [chunk] if (chunk := sampler.add(frame, stamp)) else []
        else:  # off the clock: evidence, decoded where the new timeline would sample it
            wanted = sampler.evidence_wants(stamp)
            frame = self._decode(decode, outcome) if wanted else None
            if frame is not None or not wanted:  # an undecodable frame is no evidence
                outcome.event, outcome.chunks = sampler.propose(
                    frame, stamp, stamp if arrival is None else arrival)
        if sampler.stamp_outliers > outliers:
            count = sampler.stamp_outliers - outliers
            self._refuse(outcome, f"{count} frame(s) stamped off the stream clock dropped: a "
                         f"new timeline needs {sampler.confirm_s:g} s of frames with none on "
                         "the current clock", count)
        return outcome

    def _decode(self, decode: Callable[[], np.ndarray], outcome: GateOutcome
                ) -> np.ndarray | None:
        try:
            frame = decode()
            check_frame_size(*frame.shape[:2])  # any decoder: offline videos, benchmarks
        except FrameError as error:
            self._refuse(outcome, str(error), 1)
            return None
        return frame

    def _refuse(self, outcome: GateOutcome, reason: str, frames: int) -> None:
        self.bad_frames += frames
        self.last_error = outcome.error = reason
