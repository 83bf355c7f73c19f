"""The thread that owns the model: chunks in a bounded queue, questions answered between chunks.

Camera callbacks must never wait for the model, and a question must not wait behind a backlog of
video. So one worker thread owns the `StreamingMemory`; callers hand it work:

- `submit_chunk` never blocks: when `queue_chunks` chunks are already waiting, the oldest one is
  dropped and counted (under overload the memory keeps the newest video, as a camera would).
- `ask` and `call` block the calling thread (a service callback) until the worker has served
  them, and return what the worker computed (nothing of the memory is read from another
  thread). Questions and calls are served before waiting chunks, in order of arrival; `post`ed
  operations (a time jump's reset, an autosave) keep their place among the chunks, so that a
  chunk from before a time jump never lands after the reset and an autosave runs between two
  chunks, never inside a report. Each kind of work is a small class (`_Question`,
  `_Operation`) that serves itself.
- A failure is counted under the name of what failed (`questions_failed`, `failed["save"]`, ...);
  a ValueError is the caller's mistake (an empty question, a file refused): returned to the
  caller and counted in `requests_refused`, not as a failure.

No rclpy here: the node wires callbacks to it, tests drive it directly.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.config import StreamConfig
from ..core.frames import SampledChunk
from ..core.memory import Answer, ChunkResult, StreamingMemory
from ..core.poses import Pose


@dataclass
class WorkerCounters:
    chunks_processed: int = 0
    chunks_dropped: int = 0
    chunks_failed: int = 0
    reports_failed: int = 0  # on_chunk raised: the chunk is in memory, its report is lost
    chunks_discarded: int = 0  # waiting chunks of a stream that a reset or load ended
    questions_answered: int = 0
    questions_failed: int = 0
    requests_refused: int = 0  # the caller's mistakes (ValueError): not failures
    failed: Counter = field(default_factory=Counter)  # other operations, by name
    last_error: str = ""
    last_error_time: float = 0.0  # time.monotonic() of the last failure


@dataclass(kw_only=True)
class _Request:
    """Work for the worker between chunks, answered once: `done` is set with `answer` or
    `error`."""

    done: threading.Event = field(default_factory=threading.Event)
    answer: Any = None
    error: str = ""
    started: bool = False
    waited: bool = True  # False: posted, nobody waits for the result

    @property
    def kind(self) -> str:
        """What the work is called in errors and in `counters.failed`."""
        raise NotImplementedError

    def serve(self, memory: StreamingMemory) -> Any:
        """Do the work on the worker thread; its answer."""
        raise NotImplementedError


@dataclass(kw_only=True)
class _Question(_Request):
    """A question; `interrupted`: told to stop at its next token (stop, cancel)."""

    question: str
    max_new_tokens: int | None
    options: dict[str, Any]  # StreamingMemory.ask keywords
    interrupted: bool = False
    kind = "ask"

    def serve(self, memory: StreamingMemory) -> Answer:
        asked = self.options.get("cancelled") or (lambda: False)
        return memory.ask(self.question, self.max_new_tokens, **self.options
                          | {"cancelled": lambda: self.interrupted or asked()})


@dataclass(kw_only=True)
class _Operation(_Request):
    """function(memory): a whole-memory operation called or posted by name ("save", ...)."""

    name: str
    function: Callable[[StreamingMemory], Any]

    @property
    def kind(self) -> str:
        return self.name

    def serve(self, memory: StreamingMemory) -> Any:
        return self.function(memory)


class MemoryWorker:
    """Runs `memory` on its own thread. `on_chunk(chunk, result)` is called from that thread."""

    def __init__(
        self,
        memory: StreamingMemory,
        on_chunk: Callable[[SampledChunk, ChunkResult], None],
        queue_chunks: int = StreamConfig.queue_chunks,
        poll_s: float = 0.2,
        pose_at: Callable[[float], Pose | None] | None = None,
    ) -> None:
        self.memory = memory
        self.on_chunk = on_chunk
        # The robot's pose at a chunk's stamp (ros_memory.PoseInput.at): looked up when the
        # chunk is processed, so the poses received up to then count.
        self.pose_at = pose_at or (lambda stamp: None)
        self.counters = WorkerCounters()
        self.busy_s = 0.0  # time spent on chunks, for the real-time factor
        self._chunks: deque[SampledChunk | _Request] = deque()
        self._questions: deque[_Request] = deque()
        self._queue_chunks = queue_chunks
        self._poll_s = poll_s
        self._lock = threading.Condition()
        self._stopping = False
        self._current: SampledChunk | _Request | None = None  # the item being served
        self._thread = threading.Thread(target=self._run, name="deltas_memory_worker",
                                        daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------- callers' side
    def submit_chunk(self, chunk: SampledChunk) -> int:
        """Queue a chunk without blocking. Returns how many old chunks were dropped for it."""
        dropped = 0
        with self._lock:
            while self._waiting_chunks() >= self._queue_chunks:
                oldest = next(i for i, item in enumerate(self._chunks)
                              if isinstance(item, SampledChunk))
                del self._chunks[oldest]
                dropped += 1
            self.counters.chunks_dropped += dropped
            self._chunks.append(chunk)
            self._lock.notify()
        return dropped

    def ask(self, question: str, max_new_tokens: int | None, timeout_s: float,
            **options: Any) -> Answer:
        """Answer between chunks; raises TimeoutError, or RuntimeError with the engine's error.

        options: StreamingMemory.ask's keywords (since, until, on_token, cancelled); on_token
        and cancelled are called on the worker thread."""
        request = self._submit(_Question(question=question, max_new_tokens=max_new_tokens,
                                         options=options), self._questions)
        return self._wait(request, timeout_s)

    def call(self, function: Callable[[StreamingMemory], Any], timeout_s: float,
             name: str = "call") -> Any:
        """Run function(memory) on the worker between chunks (like a question); its result.

        For whole-memory operations such as saving and loading, which must not interleave with
        a chunk. A failure other than ValueError is counted in `counters.failed[name]`.
        """
        request = self._submit(_Operation(name=name, function=function), self._questions)
        return self._wait(request, timeout_s)

    def post(self, function: Callable[[StreamingMemory], Any], name: str,
             coalesce: bool = False) -> bool:
        """Queue function(memory) in order with the chunks, without waiting (from the worker's
        own report callback, or a camera callback). coalesce: not if one of this name already
        waits. Returns whether it was queued."""
        with self._lock:
            if self._stopping or coalesce and any(
                    isinstance(item, _Operation) and item.name == name for item in self._chunks):
                return False
            self._chunks.append(_Operation(name=name, function=function, waited=False))
            self._lock.notify()
        return True

    def discard_chunks(self) -> int:
        """Drop every waiting chunk (counted in chunks_discarded); from a worker operation that
        ends the stream they belong to (reset, load). Queued operations stay."""
        with self._lock:
            kept = deque(item for item in self._chunks if not isinstance(item, SampledChunk))
            discarded = len(self._chunks) - len(kept)
            self._chunks = kept
            self.counters.chunks_discarded += discarded
        return discarded

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return self._waiting_chunks()

    @property
    def serving(self) -> str:
        """What the worker is doing now: "" (idle), "chunk", "ask", or an operation's name."""
        with self._lock:
            current = self._current
        if current is None:
            return ""
        return "chunk" if isinstance(current, SampledChunk) else current.kind

    @property
    def questions_waiting(self) -> int:
        """Questions and calls not yet started."""
        with self._lock:
            return len(self._questions)

    def cancel_questions(self, why: str) -> int:
        """Refuse the questions waiting (their callers hear `why`) and stop the one being
        answered at its next token (its caller gets the answer so far, marked cancelled);
        how many questions were affected. Other calls keep their places."""
        with self._lock:
            waiting = [r for r in self._questions if isinstance(r, _Question)]
            self._questions = deque(r for r in self._questions if not isinstance(r, _Question))
            current = self._current
            if isinstance(current, _Question):
                current.interrupted = True
                waiting.append(current)
        for request in waiting[:-1] if current in waiting else waiting:
            request.error = why
            request.done.set()
        return len(waiting)

    @property
    def alive(self) -> bool:
        """Whether the worker thread still runs (after stop: an item it could not leave)."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Fail waiting requests and the one in progress (its caller returns at once; a
        question stops at its next token), let the item in progress finish, and join the
        thread; whether it ended within timeout_s."""
        with self._lock:
            self._stopping = True
            current = self._current
            self._lock.notify_all()
        if isinstance(current, _Request):
            current.interrupted = True
            current.error = "the memory is shutting down"
            current.done.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # --------------------------------------------------------------------- worker's side
    def _submit(self, request: _Request, queue: deque) -> _Request:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the memory is shutting down")
            queue.append(request)
            self._lock.notify()
        return request

    def _wait(self, request: _Request, timeout_s: float) -> Any:
        if not request.done.wait(timeout_s):
            with self._lock:  # nobody waits for it any more: do not spend the model on it
                for queue in (self._questions, self._chunks):
                    position = next((i for i, item in enumerate(queue) if item is request), None)
                    if position is not None:
                        del queue[position]
                why = self._why_late(request)
            raise TimeoutError(f"no answer within {timeout_s:.1f} s ({why})")
        if request.error:
            raise RuntimeError(request.error)
        return request.answer

    def _why_late(self, request: _Request) -> str:
        """Waiting behind other work, or being served when the time ran out (lock held)."""
        if request.started:
            return f"the {request.kind} was still running: the timeout is shorter than it takes"
        current = self._current
        if current is None:
            return "the worker had not picked it up yet: the timeout is very short"
        doing = "a chunk" if isinstance(current, SampledChunk) else f"a {current.kind}"
        return f"the worker is busy with {doing}"

    def _waiting_chunks(self) -> int:
        return sum(isinstance(item, SampledChunk) for item in self._chunks)

    def _next(self) -> SampledChunk | _Request | None:
        """The next item: questions first, then chunks and resets in order."""
        with self._lock:
            while not (self._questions or self._chunks or self._stopping):
                self._lock.wait(self._poll_s)
            if self._stopping:
                return None
            self._current = (self._questions or self._chunks).popleft()
            if isinstance(self._current, _Request):
                self._current.started = True
            return self._current

    def _run(self) -> None:
        while (item := self._next()) is not None:
            if isinstance(item, SampledChunk):
                self._process_chunk(item)
            else:
                self._serve(item)
            with self._lock:
                self._current = None
        with self._lock:
            pending = list(self._questions) + [i for i in self._chunks
                                               if isinstance(i, _Request)]
        for request in pending:
            request.error = "the memory is shutting down"
            request.done.set()

    def _process_chunk(self, chunk: SampledChunk) -> None:
        start = time.perf_counter()
        try:
            result = self.memory.add_sampled(chunk, pose=self.pose_at(chunk.stamps[-1]))
        except Exception as error:  # a failed chunk must not stop the worker
            self.counters.chunks_failed += 1
            self._note_error(f"chunk {chunk.index} failed: {error}")
            return
        finally:
            self.busy_s += time.perf_counter() - start
        self.counters.chunks_processed += 1
        try:
            self.on_chunk(chunk, result)
        except Exception as error:  # a broken report must not stop the memory either
            self.counters.reports_failed += 1
            self._note_error(f"reporting chunk {chunk.index} failed: {error}")

    def _serve(self, request: _Request) -> None:
        try:
            request.answer = request.serve(self.memory)
            if isinstance(request, _Question):
                self.counters.questions_answered += 1
        except Exception as error:  # reported to the caller; the worker goes on
            # A caller's mistake (an empty question, a refused file) is not a failure; a posted
            # operation (an autosave) has no caller, so there every error is one.
            if isinstance(error, ValueError) and request.waited:
                request.error = str(error)
                self.counters.requests_refused += 1
                return
            request.error = f"{request.kind} failed: {error}"
            if isinstance(request, _Question):
                self.counters.questions_failed += 1
            else:
                self.counters.failed[request.kind] += 1
            self._note_error(request.error)
        finally:
            request.done.set()

    def _note_error(self, message: str) -> None:
        """The newest failure, for diagnostics (ERROR for a while)."""
        self.counters.last_error = message
        self.counters.last_error_time = time.monotonic()
