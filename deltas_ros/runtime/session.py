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

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.frames import FrameGate, FrameSampler, GateOutcome, SampledChunk, TimeEvent
from ..core.loader import check_model_files, load_model
from ..core.memory import Answer, ChunkResult, MemoryStats, StreamingMemory, question_problem
from ..core.persistence import load_memory, save_memory
from ..core.plan import require_fit
from ..core.poses import Pose
from ..core.results import HeldChunk
from .files import MemoryFiles, MemoryPathError, read_key, read_metadata
from .health import Level, loading_health, report
from .params import BY_NAME, Parameters, memory_config, validate
from .resources import memory_in_use, release_memory
from .session_counters import SessionCounters
from .stream_record import StreamRecord, continue_clock
from .worker import MemoryWorker

FRAME_ID_MAX = 256  # characters of a camera frame_id copied into reports
NOT_READY = "not ready: the model is still loading"
NOT_CONFIGURED = "not configured: the node is unconfigured (lifecycle); configure it first"
NOT_ACTIVE = "not active: the node is inactive (lifecycle); activate it to ask"
# An answer cut short because the node left active (deactivate, cleanup, shutdown).
STOPPED = "cancelled: the node stopped taking questions (lifecycle); the answer so far"
JUMP_RESET = "jump_reset"  # the worker operation a time jump back queues (save, then reset);
# health.report counts its failures as failed saves


@dataclass(frozen=True)
class OpResult:
    """What a whole-memory operation left, computed on the worker."""

    chunks: int  # chunks the memory has seen
    kv_tokens: int
    discarded: int = 0  # waiting chunks of the ended stream


class Refused(RuntimeError):
    """A request refused before it reached the model: the client's mistake or the node's state
    (not ready, not active); the message says which."""


class Session:
    """The node's state. `values`: the node's current parameters (`Parameters`, shared with the
    node: a change there is seen here)."""

    def __init__(self, values: dict[str, Any] | Parameters, files: MemoryFiles,
                 key: bytes | None = None) -> None:
        self.params = values if isinstance(values, Parameters) else Parameters(values)
        values = self.params.values
        self.files = files
        self.key = key
        self.sampler = FrameSampler(values["fps"], values["frames_per_chunk"],
                                    values["max_gap_s"], confirm_s=values["timeline_confirm_s"])
        self.gate = FrameGate(self.sampler)
        self.frame_lock = threading.Lock()  # the sampler: camera thread and worker operations
        self.ready = False  # the model is loaded and the worker runs
        # Lifecycle: whether the node is active (camera intake and questions). The node gives
        # its managed state (rclpy's); a session without a node is never active.
        self.node_active: Callable[[], bool] = lambda: False
        self.memory: StreamingMemory | None = None
        self.worker: MemoryWorker | None = None
        self.stats: MemoryStats | None = None  # refreshed on the worker
        self.record: StreamRecord | None = None  # worker thread only
        self.live_stamp: float | None = None  # last stamp of the newest chunk the gate made
        self.frame_id = ""
        self.last_result: ChunkResult | None = None
        self.counters = SessionCounters()  # what health reports

    @property
    def values(self) -> dict[str, Any]:
        return self.params.values

    @values.setter
    def values(self, values: dict[str, Any]) -> None:
        self.params.values = values

    # ----------------------------------------------------------------------------- readiness
    @classmethod
    def configure(cls, values: dict[str, Any] | Parameters) -> Session:
        """The session for the node's parameter `values` (lifecycle configure); ValueError or
        OSError with a reason a user can act on: a bad value, no model or one with files outside
        its directory, an unusable memory_dir or key file."""
        p = values.values if isinstance(values, Parameters) else values
        if problem := validate(p):
            raise ValueError(problem)
        if not (Path(p["model_path"]) / "config.json").is_file():
            raise FileNotFoundError(f"no model at {p['model_path']}: config.json is missing")
        check_model_files(p["model_path"])  # before the memory plan reads config.json
        return cls(values, MemoryFiles(p["memory_dir"], p["memory_file"]),
                   read_key(p["memory_key_file"]))

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

    def attach(self, memory: StreamingMemory,
               publish: Callable[[SampledChunk, ChunkResult, list[HeldChunk]], None],
               pose_at: Callable[[float], Pose | None] | None = None) -> MemoryWorker:
        """The model is loaded: start the worker; from now on the session is READY.
        publish(chunk, result, the held chunks): after the session has recorded each
        chunk (`chunk_done`), what the node sends out; pose_at: the robot's pose at a stamp,
        tagging each chunk (both on the worker thread)."""
        self.memory, self.stats = memory, memory.stats()

        def on_chunk(chunk: SampledChunk, result: ChunkResult) -> None:
            self.chunk_done(chunk, result)
            publish(chunk, result, self.stats.held)

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
            if self.memory is not None:
                self.memory.close()
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
        self.counters.last_frame_wall = arrival = time.monotonic()
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
                self.counters.chunks_before_ready += 1
            else:
                dropped += worker.submit_chunk(chunk)
        return outcome, dropped

    def note_callback_error(self) -> None:
        self.counters.callback_errors += 1

    def note_pose_refused(self) -> None:
        with self.counters.lock:
            self.counters.poses_refused += 1

    # ----------------------------------------------------------------------------- worker side
    def chunk_done(self, chunk: SampledChunk, result: ChunkResult) -> None:
        """Worker thread, after each chunk: the record, the latency window, the autosave."""
        self.record = StreamRecord.after(chunk)
        self.last_result, self.stats = result, self.memory.stats()
        self.counters.latencies_ms.append(result.forward_ms + result.signal_ms + result.evict_ms)
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
        self.counters.resets += 1
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
                self.counters.reset_saves += 1
            except (MemoryPathError, RuntimeError, OSError) as error:
                failure = f"saving the memory to {path} before a time-jump reset failed: {error}"
        memory.reset()
        self.counters.resets += 1
        self._done(memory, record=None)
        if failure:
            raise RuntimeError(failure)

    def autosave(self, memory: StreamingMemory) -> None:
        """Worker thread: save to the default file (every autosave_chunks, and at shutdown)."""
        self.save(memory, self.files.default)
        self.counters.autosaves += 1

    def _done(self, memory: StreamingMemory, record: StreamRecord | None,
              discarded: int = 0) -> OpResult:
        self.record, self.stats = record, memory.stats()
        return OpResult(memory.chunks_seen, memory.kv_tokens, discarded)

    # ----------------------------------------------------------------------------- requests
    def ask(self, question: str, max_new_tokens: int, **options: Any) -> Answer:
        """Executor threads: a question answered by the worker between chunks (max_new_tokens
        0: the parameter's). Refused with the reason (`question_refusal`) before it costs model
        time; RuntimeError or TimeoutError if answering fails. options: StreamingMemory.ask's."""
        if problem := self.question_refusal(question, max_new_tokens):
            raise Refused(problem)
        values = self.values
        # A question accepted in the instant before a deactivate reaches the worker after the
        # deactivate's cancel: it stops at its first token as the one in progress then did.
        asked = options.pop("cancelled", None) or (lambda: False)
        return self.worker.ask(question, max_new_tokens or values["max_new_tokens"],
                               values["ask_timeout_s"],
                               cancelled=lambda: asked() or not self.active, **options)

    def operate(self, verb: str, path: Path | None = None) -> OpResult:
        """Executor threads: "reset", "save" or "load" (of `path`, from `resolve_file`) on the
        worker between chunks; Refused while not ready, RuntimeError or TimeoutError if it
        fails."""
        if not self.ready:
            raise Refused(NOT_READY)
        operation = {"reset": self.reset, "save": lambda memory: self.save(memory, path),
                     "load": lambda memory: self.load(memory, path)}[verb]
        return self.worker.call(operation, self.values["ask_timeout_s"], verb)

    def resolve_file(self, requested: str) -> Path:
        """A client's memory file path inside memory_dir; a refused one (MemoryPathError) is
        counted as a client mistake."""
        try:
            return self.files.resolve(requested)
        except MemoryPathError:
            with self.counters.lock:
                self.counters.requests_refused += 1
            raise

    @property
    def active(self) -> bool:
        """Lifecycle: whether the node is active, as `node_active` says now."""
        return self.node_active()

    @property
    def serving_questions(self) -> bool:
        """Whether questions are taken now: loaded and active."""
        return self.ready and self.active

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
            with self.counters.lock:
                self.counters.questions_refused += 1
        return problem

    # ----------------------------------------------------------------------------- health
    def health(self) -> tuple[Level, str, dict[str, Any]]:
        """Level, message and values of the 1 Hz diagnostics report (`health.report`; while
        the model loads, `health.loading_health`)."""
        if not self.ready:
            return loading_health(self.values)
        return report(self.counters, self.values, active=self.active, gate=self.gate,
                      worker=self.worker, memory=self.memory, stats=self.stats,
                      result=self.last_result)
