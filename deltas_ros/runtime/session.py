"""The node's state without ROS: the stream clock, whole-memory operations, counters and health.

node.py wires ROS to this class; everything here is tested without DDS (test_session.py).

Threads. The camera thread calls `take_frame`; the worker thread (worker.py) runs `chunk_done`
and every whole-memory operation (`reset`, `save`, `load`, the autosave), so that they see the
memory and the stream record together, between two chunks; executor threads only call the
worker and read counters. Results of memory operations (`OpResult`) are computed on the worker
and returned from it; nothing of the memory is read from another thread.

The stream record (`StreamRecord`: stream start, last stamp, next chunk index) says where the
memory's stream stands. It changes only on the worker: after each chunk, to nothing on a reset,
to the file's on a load. A save writes it; a load continues it (see `continue_clock`). A reset
or a load ends the stream the waiting chunks belong to: they are discarded and counted.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.frames import FrameGate, FrameSampler, GateOutcome, SampledChunk, TimeEvent
from ..core.loader import load_model
from ..core.memory import ChunkResult, MemoryStats, StreamingMemory, question_problem
from ..core.persistence import load_memory, save_memory
from ..core.plan import require_fit
from ..core.poses import Pose
from .files import MemoryFiles, MemoryPathError, read_key, read_metadata
from .params import BY_NAME, memory_config, validate
from .worker import MemoryWorker

ERROR_HOLD_S = 10.0  # diagnostics stay ERROR this long after a failed chunk or operation
LATENCY_WINDOW = 30  # chunks in the latency median
FRAME_ID_MAX = 256  # characters of a camera frame_id copied into reports
NOT_READY = "not ready: the model is still loading"
NOT_CONFIGURED = "not configured: the node is unconfigured (lifecycle); configure it first"
NOT_ACTIVE = "not active: the node is inactive (lifecycle); activate it to ask"
# An answer cut short because the node left active (deactivate, cleanup, shutdown).
STOPPED = "cancelled: the node stopped taking questions (lifecycle); the answer so far"
MAX_STREAM_INDEX = 2**31 - 1
JUMP_RESET = "jump_reset"  # the worker operation a time jump back queues (save, then reset)


class Level(enum.IntEnum):
    """diagnostic_msgs/DiagnosticStatus levels."""

    OK = 0
    WARN = 1
    ERROR = 2


def loading_health(values: dict[str, Any]) -> tuple[Level, str, dict[str, Any]]:
    """The diagnostics report while the model loads (also before autostart has a session)."""
    return Level.WARN, "loading the model", {"model": values["model_path"]}


@dataclass(frozen=True)
class StreamRecord:
    """Where the memory's stream stands: what a save records and a load continues from."""

    stream_start: float  # header stamp (s) stream times count from
    last_stamp: float  # header stamp of the newest chunk's last frame
    next_chunk_index: int

    @classmethod
    def after(cls, chunk: SampledChunk) -> StreamRecord:
        return cls(chunk.stamps[-1] - chunk.times[-1], chunk.stamps[-1], chunk.index + 1)

    def to_json(self) -> dict[str, float | int]:
        return {"stream_start": self.stream_start, "last_stamp": self.last_stamp,
                "next_chunk_index": self.next_chunk_index}

    @classmethod
    def from_json(cls, value: Any) -> StreamRecord | None:
        """The record of a file's `extra.stream` ({} = saved before any chunk: None).

        Raises ValueError for anything but finite stamps in order and an index in range.
        """
        if value == {}:
            return None
        if not isinstance(value, dict) or set(value) != {"stream_start", "last_stamp",
                                                          "next_chunk_index"}:
            raise ValueError(f"malformed stream record {str(value)[:200]!r}")
        start, last, index = value["stream_start"], value["last_stamp"], value["next_chunk_index"]
        stamps_ok = all(isinstance(s, (int, float)) and not isinstance(s, bool)
                        and math.isfinite(s) and s >= 0 for s in (start, last))
        if not stamps_ok or start > last:
            raise ValueError(f"stream record stamps are not finite, >= 0 and in order: "
                             f"start {start!r}, last {last!r}")
        if type(index) is not int or not 0 <= index <= MAX_STREAM_INDEX:
            raise ValueError(f"stream record next_chunk_index {index!r} is out of range")
        return cls(float(start), float(last), index)


def continue_clock(record: StreamRecord, live_stamp: float | None, live_index: int,
                   fps: float) -> tuple[float, float, int]:
    """(stream start, last stamp, next index) for FrameSampler.resume after loading `record`.

    The rule: with no chunk from the camera yet (since the start or a reset), the saved stream
    continues as it was (a restart).
    With a live camera at `live_stamp` on or after the saved last stamp (the file's own clock),
    stream times keep the saved start (the time in between is a gap), and indices go on from
    the later of the file's and the camera's (`live_index`): chunks the camera made after the
    save left the memory with the load, but their indices were published and are never given
    twice. With a live camera behind the saved stamps (another clock: a replay, sim time), the
    live stream continues the saved one one frame period after its last frame, its indices too
    from the later of the two. Never a jump back: loading does not wipe what it loaded.
    """
    if live_stamp is None:
        return record.stream_start, record.last_stamp, record.next_chunk_index
    if live_stamp >= record.last_stamp:
        return record.stream_start, live_stamp, max(record.next_chunk_index, live_index)
    saved_span = record.last_stamp - record.stream_start
    return (live_stamp - saved_span - 1.0 / fps, live_stamp,
            max(record.next_chunk_index, live_index))


def memory_in_use() -> dict[str, int]:
    """Bytes this process holds: `rss` (Linux), and `cuda_allocated` once CUDA is in use."""
    use = {}
    status = Path("/proc/self/status")
    if status.exists():
        rss = [line for line in status.read_text().splitlines() if line.startswith("VmRSS:")]
        use["rss"] = int(rss[0].split()[1]) * 1024 if rss else 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        use["cuda_allocated"] = torch.cuda.memory_allocated()
    return use


def release_memory() -> None:
    """Give what nothing refers to any more back to the system: collect cycles, empty torch's
    CUDA cache, and trim glibc's heap (freed small blocks otherwise stay in the process)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclass(frozen=True)
class OpResult:
    """What a whole-memory operation left, computed on the worker."""

    chunks: int  # chunks the memory has seen
    kv_tokens: int
    discarded: int = 0  # waiting chunks of the ended stream


class Session:
    """The node's state. `values` is the node's current parameter dict (replaced on change)."""

    def __init__(self, values: dict[str, Any], files: MemoryFiles,
                 key: bytes | None = None) -> None:
        self.values = values
        self.files = files
        self.key = key
        self.sampler = FrameSampler(values["fps"], values["frames_per_chunk"],
                                    values["max_gap_s"], confirm_s=values["timeline_confirm_s"])
        self.gate = FrameGate(self.sampler)
        self.frame_lock = threading.Lock()  # the sampler: camera thread and worker operations
        self.counter_lock = threading.Lock()
        self.ready = False  # the model is loaded and the worker runs
        self.active = False  # lifecycle: camera intake and questions (node.py sets it)
        self.memory: StreamingMemory | None = None
        self.worker: MemoryWorker | None = None
        self.stats: MemoryStats | None = None  # refreshed on the worker
        self.record: StreamRecord | None = None  # worker thread only
        self.live_stamp: float | None = None  # last stamp of the newest chunk the gate made
        self.frame_id = ""
        self.last_result: ChunkResult | None = None
        self.latencies_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.callback_errors = 0
        self.chunks_before_ready = 0
        self.questions_refused = 0  # client mistakes refused before reaching the worker
        self.requests_refused = 0
        self.autosaves = 0
        self.resets = 0  # worker thread only
        self.reset_saves = 0  # memories saved before a time jump reset them (worker thread)
        self.poses_refused = 0  # pose messages refused at the subscription
        self.started_wall = time.monotonic()
        self.last_frame_wall = 0.0
        self._at_last_report = {"frames": 0, "drops": 0, "bad": 0}

    # ----------------------------------------------------------------------------- readiness
    @classmethod
    def configure(cls, values: dict[str, Any]) -> Session:
        """The session for the node's parameter `values` (lifecycle configure); ValueError or
        OSError with a reason a user can act on: a bad value, no model, an unusable memory_dir
        or key file."""
        if problem := validate(values):
            raise ValueError(problem)
        if not (Path(values["model_path"]) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {values['model_path']}: config.json is missing")
        return cls(values, MemoryFiles(values["memory_dir"], values["memory_file"]),
                   read_key(values["memory_key_file"]))

    def open_memory(self) -> tuple[StreamingMemory, str]:
        """Load the model and open its memory, continuing memory_file with load_on_start:
        (the memory, a load_on_start problem or ""). RuntimeError with the reason if the model
        and its memory would not fit on the device (`plan.require_fit`, before loading) or the
        model does not load. Before `attach`: nothing else touches the memory yet."""
        p = self.values
        try:
            require_fit(p["model_path"], memory_config(p), p["device"], p["dtype"], p["fps"],
                        p["frames_per_chunk"])
            memory = StreamingMemory(load_model(p["model_path"], p["device"], p["dtype"]),
                                     memory_config(p))
        except Exception as error:  # any failure to load, with its reason
            raise RuntimeError(f"cannot load the model from {p['model_path']}: {error}") \
                from error
        problem = ""
        if p["load_on_start"] and self.files.default.exists():
            try:
                self.load(memory, self.files.default)
            except (ValueError, OSError) as error:
                problem = f"load_on_start: {error}; starting with an empty memory"
        return memory, problem

    def attach(self, memory: StreamingMemory, on_chunk: Callable[[SampledChunk, ChunkResult],
                                                                 None],
               pose_at: Callable[[float], Pose | None] | None = None) -> MemoryWorker:
        """The model is loaded: start the worker; from now on the session is READY.
        pose_at: the robot's pose at a stamp, tagging each chunk (worker thread)."""
        self.memory, self.stats = memory, memory.stats()
        self.worker = MemoryWorker(memory, on_chunk, self.values["queue_chunks"],
                                   pose_at=pose_at)
        self.ready = True
        return self.worker

    def close(self, timeout_s: float) -> tuple[bool, str]:
        """Stop the worker and free the memory and the model (lifecycle cleanup and shutdown):
        (whether the worker ended within timeout_s, what was freed, measured). A worker that
        did not end stays in `worker` (it holds the model until its item ends)."""
        before = memory_in_use()
        ended = self.worker.stop(timeout_s) if self.worker is not None else True
        if ended:
            self.worker = None
        self.memory = self.last_result = None
        self.ready = False
        release_memory()
        after = memory_in_use()
        return ended, ", ".join(f"{key} {before[key] / 2**20:.0f} -> {after[key] / 2**20:.0f} MiB"
                                for key in before if key in after)

    # ----------------------------------------------------------------------------- camera
    def take_frame(self, stamp: float, decode: Callable[[], np.ndarray],
                   frame_id: str = "") -> tuple[GateOutcome, int]:
        """Camera thread: one frame through the gate; (its outcome, chunks dropped for it).

        Finished chunks go to the worker (when ready; before, they are counted); a jump back
        queues a reset in order with the chunks. The arrival time that confirms a new timeline
        is this call's."""
        self.last_frame_wall = arrival = time.monotonic()
        with self.frame_lock:
            outcome = self.gate.push(stamp, decode, arrival)
            if outcome.chunks:  # only accepted frames make chunks: the live clock
                self.live_stamp = outcome.chunks[-1].stamps[-1]
        worker = self.worker
        if outcome.event is TimeEvent.JUMP_BACK and worker is not None:
            worker.post(self._reset_after_jump, JUMP_RESET)
        dropped = 0
        for chunk in outcome.chunks:
            self.frame_id = frame_id[:FRAME_ID_MAX]
            if worker is None:
                self.chunks_before_ready += 1
            else:
                dropped += worker.submit_chunk(chunk)
        return outcome, dropped

    def note_callback_error(self) -> None:
        self.callback_errors += 1

    def note_pose_refused(self) -> None:
        with self.counter_lock:
            self.poses_refused += 1

    # ----------------------------------------------------------------------------- worker side
    def chunk_done(self, chunk: SampledChunk, result: ChunkResult) -> None:
        """Worker thread, after each chunk: the record, the latency window, the autosave."""
        self.record = StreamRecord.after(chunk)
        self.last_result, self.stats = result, self.memory.stats()
        self.latencies_ms.append(result.forward_ms + result.signal_ms + result.evict_ms)
        every = self.values["autosave_chunks"]
        if every and (chunk.index + 1) % every == 0:
            # Queued, not done here: a large save must not hold up this chunk's report.
            self.worker.post(self.autosave, "autosave", coalesce=True)

    def reset(self, memory: StreamingMemory) -> OpResult:
        """Worker thread: forget everything; the waiting chunks of the old stream are discarded
        and the next frame starts a new stream at index 0."""
        memory.reset()
        with self.frame_lock:
            discarded = self.worker.discard_chunks()
            self.sampler.reset()
            self.live_stamp = None
        self.resets += 1
        return self._done(memory, record=None, discarded=discarded)

    def save(self, memory: StreamingMemory, path: Path) -> OpResult:
        """Worker thread: write the memory and its stream record to `path` (inside memory_dir).

        Only a refused path is the caller's mistake (MemoryPathError, a ValueError); anything
        else that stops the write is a failed save (RuntimeError), counted as one."""
        stream = self.record.to_json() if self.record else {}
        target = self.files.for_saving(path)
        try:
            save_memory(memory, target, extra={"stream": stream}, key=self.key)
        except ValueError as error:
            raise RuntimeError(f"cannot write the memory to {target}: {error}") from error
        return self._done(memory, record=self.record)

    def load(self, memory: StreamingMemory, path: Path) -> OpResult:
        """Worker thread: replace the memory with the file's and continue its stream by
        `continue_clock`. Its stream record is checked before the memory is touched."""
        path = self.files.for_loading(path)
        extra = read_metadata(path).get("extra", {})
        record = StreamRecord.from_json(extra.get("stream", {}) if isinstance(extra, dict)
                                        else extra)
        load_memory(memory, path, key=self.key)
        with self.frame_lock:
            discarded = self.worker.discard_chunks() if self.worker else 0
            if record is None:
                self.sampler.reset()
                self.live_stamp = None
            else:
                self.sampler.resume(*continue_clock(record, self.live_stamp,
                                                    self.sampler.next_index,
                                                    self.sampler.fps))
        return self._done(memory, record=record, discarded=discarded)

    def _reset_after_jump(self, memory: StreamingMemory) -> None:
        """Worker thread, queued by the camera in order with the chunks: the sampler has
        already started the new stream; the memory is saved (MemoryFiles.before_reset), then
        it and the record follow. A failed save does not stop the reset (the new stream's
        chunks cannot join the old one): it is raised afterwards, counted and reported."""
        failure = ""
        if memory.chunks_seen:
            path = self.files.before_reset()
            try:
                self.save(memory, path)
                self.reset_saves += 1
            except (MemoryPathError, RuntimeError, OSError) as error:
                failure = f"saving the memory to {path} before a time-jump reset failed: {error}"
        memory.reset()
        self.resets += 1
        self._done(memory, record=None)
        if failure:
            raise RuntimeError(failure)

    def autosave(self, memory: StreamingMemory) -> None:
        """Worker thread: save to the default file (every autosave_chunks, and at shutdown)."""
        self.save(memory, self.files.default)
        self.autosaves += 1

    def _done(self, memory: StreamingMemory, record: StreamRecord | None,
              discarded: int = 0) -> OpResult:
        self.record, self.stats = record, memory.stats()
        return OpResult(memory.chunks_seen, memory.kv_tokens, discarded)

    # ----------------------------------------------------------------------------- requests
    def question_refusal(self, question: str, max_new_tokens: int) -> str:
        """Why a question is refused before it costs model time ("" = accepted); counted."""
        limit = int(BY_NAME["max_new_tokens"].high)
        problem = "" if self.ready else NOT_READY
        problem = problem or ("" if self.active else NOT_ACTIVE)
        problem = problem or question_problem(question, self.values["max_question_chars"],
                                              wire=True)
        if not problem and max_new_tokens > limit:
            problem = (f"max_new_tokens {max_new_tokens} is above the limit {limit} (the "
                       "max_new_tokens parameter's range)")
        if problem:
            with self.counter_lock:
                self.questions_refused += 1
        return problem

    def refuse_request(self) -> None:
        """Count another client mistake (a memory file path refused)."""
        with self.counter_lock:
            self.requests_refused += 1

    # ----------------------------------------------------------------------------- health
    def health(self) -> tuple[Level, str, dict[str, Any]]:
        """Level, message and values of the 1 Hz diagnostics report. WARN on what happened
        since the previous report, not forever after one dropped chunk or bad frame."""
        if not self.ready:
            return loading_health(self.values)
        counters, sampler, worker = self.worker.counters, self.sampler, self.worker
        now, last = time.monotonic(), self._at_last_report
        bad = self.gate.bad_frames + self.callback_errors
        new_drops, new_bad = counters.chunks_dropped - last["drops"], bad - last["bad"]
        frames_per_s = sampler.received - last["frames"]
        self._at_last_report = {"frames": sampler.received, "drops": counters.chunks_dropped,
                                "bad": bad}
        latency = statistics.median(self.latencies_ms) if self.latencies_ms else 0.0
        seconds_per_chunk = self.values["frames_per_chunk"] / self.values["fps"]
        silent_s = now - (self.last_frame_wall or self.started_wall)
        queue_depth = worker.queue_depth
        level, message = Level.OK, "ok"
        if counters.last_error and now - counters.last_error_time < ERROR_HOLD_S:
            level, message = Level.ERROR, counters.last_error
        elif not self.active:
            level, message = Level.WARN, "inactive: camera intake stopped, memory kept"
        elif silent_s > self.values["silence_warn_s"]:
            level, message = Level.WARN, f"no camera frames for {silent_s:.0f} s"
        elif queue_depth >= self.values["queue_chunks"] or new_drops:
            level, message = Level.WARN, "model slower than real time: chunks dropped"
        elif new_bad:
            level, message = Level.WARN, f"bad frames: {self.gate.last_error}"
        stats, result, memory = self.stats, self.last_result, self.memory
        values = {
            "input_rate_hz": f"{frames_per_s:.1f}",
            "frames_received": sampler.received,
            "frames_sampled": sampler.sampled,
            "frames_dropped": sampler.dropped_frames,
            "frames_bad": self.gate.bad_frames,
            "callback_errors": self.callback_errors,
            "time_jumps_back": sampler.time_jumps_back,
            "time_gaps": sampler.time_gaps,
            "chunks_processed": counters.chunks_processed,
            "chunks_dropped": counters.chunks_dropped + self.chunks_before_ready,
            "chunks_discarded": counters.chunks_discarded,
            "chunks_failed": counters.chunks_failed,
            "reports_failed": counters.reports_failed,
            "questions_answered": counters.questions_answered,
            "questions_failed": counters.questions_failed,
            "questions_refused": self.questions_refused,
            "requests_refused": counters.requests_refused + self.requests_refused,
            "resets": self.resets,
            "saves_failed": counters.failed["save"] + counters.failed[JUMP_RESET],
            "reset_saves": self.reset_saves,
            "poses_refused": self.poses_refused,
            "loads_failed": counters.failed["load"],
            "resets_failed": counters.failed["reset"],
            "autosaves": self.autosaves,
            "autosaves_failed": counters.failed["autosave"],
            "queue_depth": queue_depth,
            "questions_waiting": worker.questions_waiting,
            "serving": worker.serving,
            "kv_tokens": stats.kv_tokens,
            "budget_tokens": memory.config.budget_tokens,
            "memory_bytes": stats.kv_bytes + stats.state_bytes,
            "position": f"{stats.next_position}/{stats.max_positions}",
            "chunk_latency_ms": f"{latency:.1f}",
            "real_time_factor": f"{latency / 1e3 / seconds_per_chunk:.3f}",
            "last_drift": f"{result.drift:.5f}" if result else "",
            "device": str(memory.device),
            "model": str(memory.loaded.path),
            "policy": memory.config.policy,
        }
        return level, message, values
