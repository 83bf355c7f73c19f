"""The thread that owns the model: chunks in a bounded queue, questions answered between chunks.

Camera callbacks must never wait for the model, and a question must not wait behind a backlog of
video. So one worker thread owns the `StreamingMemory`; callers hand it work:

- `submit_chunk` never blocks: when `queue_chunks` chunks are already waiting, the oldest one is
  dropped and counted (under overload the memory keeps the newest video, as a camera would).
- `ask` and `reset` block the calling thread (a service callback) until the worker has served
  them. Questions are served before waiting chunks, in order of arrival; resets keep their place
  among the chunks so that a chunk from before a time jump never lands after the reset.

No rclpy here: the node wires callbacks to it, tests drive it directly.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .frames import SampledChunk
from .memory import Answer, ChunkResult, StreamingMemory


@dataclass
class WorkerCounters:
    chunks_processed: int = 0
    chunks_dropped: int = 0
    chunks_failed: int = 0
    reports_failed: int = 0  # on_chunk raised: the chunk is in memory, its report is lost
    questions_answered: int = 0
    questions_failed: int = 0
    resets: int = 0
    last_error: str = ""
    last_error_time: float = 0.0  # time.monotonic() of the last failure


@dataclass
class _Request:
    kind: str  # "ask", "reset" or "call"
    question: str = ""
    max_new_tokens: int | None = None
    function: Callable[[StreamingMemory], Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    answer: Any = None
    error: str = ""


class MemoryWorker:
    """Runs `memory` on its own thread. `on_chunk(chunk, result)` is called from that thread."""

    def __init__(
        self,
        memory: StreamingMemory,
        on_chunk: Callable[[SampledChunk, ChunkResult], None],
        queue_chunks: int = 8,
        poll_s: float = 0.2,
    ) -> None:
        self.memory = memory
        self.on_chunk = on_chunk
        self.counters = WorkerCounters()
        self.busy_s = 0.0  # time spent on chunks, for the real-time factor
        self._chunks: deque[SampledChunk | _Request] = deque()
        self._questions: deque[_Request] = deque()
        self._queue_chunks = queue_chunks
        self._poll_s = poll_s
        self._lock = threading.Condition()
        self._stopping = False
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

    def ask(self, question: str, max_new_tokens: int | None, timeout_s: float) -> Answer:
        """Answer between chunks; raises TimeoutError, or RuntimeError with the engine's error."""
        request = self._submit(_Request("ask", question, max_new_tokens), self._questions)
        return self._wait(request, timeout_s)

    def call(self, function: Callable[[StreamingMemory], Any], timeout_s: float) -> Any:
        """Run function(memory) on the worker between chunks (like a question); its result.

        For whole-memory operations such as saving and loading, which must not interleave with
        a chunk.
        """
        request = self._submit(_Request("call", function=function), self._questions)
        return self._wait(request, timeout_s)

    def reset(self, timeout_s: float) -> None:
        """Forget everything, in order with the chunks already queued."""
        self._wait(self._submit(_Request("reset"), self._chunks), timeout_s)

    def request_reset(self) -> None:
        """Queue a reset without waiting (from a camera callback: a time jump)."""
        self._submit(_Request("reset"), self._chunks)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return self._waiting_chunks()

    @property
    def questions_waiting(self) -> int:
        """Questions and calls not yet started."""
        with self._lock:
            return len(self._questions)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the item in progress, fail waiting questions, and join the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout_s)

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
            raise TimeoutError(f"no answer within {timeout_s:.1f} s (the worker is busy)")
        if request.error:
            raise RuntimeError(request.error)
        return request.answer

    def _waiting_chunks(self) -> int:
        return sum(isinstance(item, SampledChunk) for item in self._chunks)

    def _next(self) -> SampledChunk | _Request | None:
        """The next item: questions first, then chunks and resets in order."""
        with self._lock:
            while not (self._questions or self._chunks or self._stopping):
                self._lock.wait(self._poll_s)
            if self._stopping:
                return None
            return (self._questions or self._chunks).popleft()

    def _run(self) -> None:
        while (item := self._next()) is not None:
            if isinstance(item, SampledChunk):
                self._process_chunk(item)
            else:
                self._serve(item)
        with self._lock:
            pending = list(self._questions) + [i for i in self._chunks
                                               if isinstance(i, _Request)]
        for request in pending:
            request.error = "the memory is shutting down"
            request.done.set()

    def _process_chunk(self, chunk: SampledChunk) -> None:
        start = time.perf_counter()
        try:
            result = self.memory.add_chunk(chunk.frames, chunk.times, stamp=chunk.stamps[-1])
        except Exception as error:  # a failed chunk must not stop the worker
            self._failed("chunks_failed", f"chunk {chunk.index} failed: {error}")
            return
        finally:
            self.busy_s += time.perf_counter() - start
        self.counters.chunks_processed += 1
        try:
            self.on_chunk(chunk, result)
        except Exception as error:  # a broken report must not stop the memory either
            self._failed("reports_failed", f"reporting chunk {chunk.index} failed: {error}")

    def _serve(self, request: _Request) -> None:
        try:
            if request.kind == "ask":
                request.answer = self.memory.ask(request.question, request.max_new_tokens)
                self.counters.questions_answered += 1
            elif request.kind == "call":
                request.answer = request.function(self.memory)
            else:
                self.memory.reset()
                self.counters.resets += 1
        except (ValueError, OSError) as error:  # the caller's: empty question, missing file
            request.error = str(error)
        except Exception as error:  # reported to the caller; the worker goes on
            request.error = f"{request.kind} failed: {error}"
            self._failed("questions_failed", request.error)
        finally:
            request.done.set()

    def _failed(self, counter: str, message: str) -> None:
        setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        self.counters.last_error = message
        self.counters.last_error_time = time.monotonic()
