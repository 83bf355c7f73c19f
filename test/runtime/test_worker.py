"""MemoryWorker without ROS: bounded queue, questions between chunks, order, failures, stop."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from engine_helpers import wait_until

from deltas_ros.core.frames import SampledChunk
from deltas_ros.runtime.worker import MemoryWorker


@dataclass
class FakeMemory:
    """Records what the worker asked of it; each chunk takes `chunk_s` seconds."""

    chunk_s: float = 0.0
    log: list = field(default_factory=list)
    fail_on: set = field(default_factory=set)
    gate: threading.Event = field(default_factory=threading.Event)
    busy: threading.Event = field(default_factory=threading.Event)  # inside a chunk
    poses: list = field(default_factory=list)  # (stamp, pose) of each chunk

    def add_chunk(self, frames, times, stamp=None, pose=None):
        self.poses.append((stamp, pose))
        self.busy.set()
        self.gate.wait(30)  # tests open it; the limit only keeps a broken test from hanging
        time.sleep(self.chunk_s)
        index = int(times[0])
        if index in self.fail_on:
            raise RuntimeError("out of memory")
        self.log.append(("chunk", index))
        return index

    def add_sampled(self, chunk, pose=None):
        return self.add_chunk(chunk.frames, chunk.times, chunk.stamps[-1], pose)

    def ask(self, question, max_new_tokens=None, cancelled=None, **options):
        """(The worker always passes `cancelled`: its own stop joined with the caller's.)"""
        if not question:
            raise ValueError("the question is empty")
        self.log.append(("ask", question, options) if options else ("ask", question))
        return f"answer to {question}"

    def reset(self):
        self.log.append(("reset",))


def chunk(i: int) -> SampledChunk:
    return SampledChunk(index=i, frames=[np.zeros((2, 2, 3), np.uint8)] * 2,
                        stamps=[float(i), i + 0.5], times=[float(i), i + 0.5])


def make_worker(memory: FakeMemory, queue: int = 4):
    done = []
    worker = MemoryWorker(memory, lambda c, r: done.append(c.index), queue_chunks=queue,
                          poll_s=0.01)
    return worker, done


def run_chunks(memory: FakeMemory, count: int, reported: int) -> tuple[MemoryWorker, list[int]]:
    """Chunks 0 to count - 1 through a worker with the gate open: (the worker, stopped once
    `reported` chunks were reported, their indices)."""
    memory.gate.set()
    worker, done = make_worker(memory)
    for i in range(count):
        worker.submit_chunk(chunk(i))
    assert wait_until(lambda: len(done) >= reported)
    worker.stop()
    return worker, done


def test_chunks_are_processed_in_order():
    worker, done = run_chunks(FakeMemory(), 4, reported=4)
    assert done == [0, 1, 2, 3] and worker.counters.chunks_processed == 4


def test_overflow_drops_the_oldest_waiting_chunks_and_counts_them():
    memory = FakeMemory()  # gate closed: the worker is stuck in chunk 0
    worker, done = make_worker(memory, queue=3)
    worker.submit_chunk(chunk(0))
    assert memory.busy.wait(5)
    dropped = sum(worker.submit_chunk(chunk(i)) for i in range(1, 7))
    assert dropped == 3 and worker.counters.chunks_dropped == 3
    assert worker.queue_depth == 3
    memory.gate.set()
    assert wait_until(lambda: len(done) >= 4)
    worker.stop()
    assert done == [0, 4, 5, 6]  # the newest video is kept


def test_questions_are_answered_between_chunks_before_waiting_chunks_in_arrival_order():
    memory = FakeMemory(chunk_s=0.01)
    worker, _ = make_worker(memory, queue=10)
    for i in range(3):
        worker.submit_chunk(chunk(i))
    assert memory.busy.wait(5)  # the worker holds chunk 0; chunks 1 and 2 wait
    answers = {}

    def planner(n: int) -> None:
        answers[n] = worker.ask(f"q{n}", None, timeout_s=5)

    threads = []
    for n in range(5):
        threads.append(threading.Thread(target=planner, args=(n,)))
        threads[-1].start()
        assert wait_until(lambda n=n: worker.questions_waiting == n + 1)  # a definite order
    memory.gate.set()
    for t in threads:
        t.join(5)
    worker.stop()
    asks = [entry[1] for entry in memory.log if entry[0] == "ask"]
    assert asks == [f"q{n}" for n in range(5)]
    assert answers == {n: f"answer to q{n}" for n in range(5)}
    # All questions came before the chunks that were waiting when they arrived.
    first_ask = memory.log.index(("ask", "q0"))
    assert [e for e in memory.log[:first_ask] if e[0] == "chunk"] == [("chunk", 0)]


def log_around(post: Callable[[MemoryWorker], None]) -> list[tuple]:
    """The memory's log of chunk 0, of what `post(worker)` queues while chunk 0 is in progress
    and chunk 1 waits to be submitted, and of chunk 1."""
    memory = FakeMemory()  # gate closed: stuck in chunk 0
    worker, _ = make_worker(memory, queue=10)
    worker.submit_chunk(chunk(0))
    assert memory.busy.wait(5)
    post(worker)
    worker.submit_chunk(chunk(1))
    memory.gate.set()
    assert wait_until(lambda: len(memory.log) >= 3)
    worker.stop()
    return memory.log


def test_reset_keeps_its_place_among_chunks():
    log = log_around(lambda worker: worker.post(lambda memory: memory.reset(), "reset"))
    assert log == [("chunk", 0), ("reset",), ("chunk", 1)]


def test_a_failing_chunk_is_counted_and_the_worker_goes_on():
    worker, done = run_chunks(FakeMemory(fail_on={1}), 3, reported=2)
    assert done == [0, 2]
    assert worker.counters.chunks_failed == 1 and "out of memory" in worker.counters.last_error


def test_caller_errors_come_back_as_errors():
    memory = FakeMemory()
    memory.gate.set()
    worker, _ = make_worker(memory)
    with pytest.raises(RuntimeError, match="empty"):
        worker.ask("", None, timeout_s=5)
    worker.stop()


def test_a_question_times_out_when_the_worker_is_busy():
    memory = FakeMemory()  # gate closed
    worker, _ = make_worker(memory)
    worker.submit_chunk(chunk(0))
    assert memory.busy.wait(5)
    with pytest.raises(TimeoutError):
        worker.ask("anyone?", None, timeout_s=0.2)
    assert worker.questions_waiting == 0  # withdrawn: nobody waits for its answer any more
    memory.gate.set()
    assert worker.ask("still there?", None, timeout_s=30).startswith("answer")
    worker.stop()
    assert [e for e in memory.log if e[0] == "ask"] == [("ask", "still there?")]


def test_stop_fails_waiting_questions_and_refuses_new_work():
    memory = FakeMemory()  # gate closed: stuck in chunk 0
    worker, _ = make_worker(memory)
    worker.submit_chunk(chunk(0))
    assert memory.busy.wait(5)
    errors = []
    t = threading.Thread(target=lambda: errors.append(
        pytest.raises(RuntimeError, worker.ask, "late", None, 30)))
    t.start()
    assert wait_until(lambda: worker.questions_waiting == 1)  # waiting when stop comes
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    memory.gate.set()
    stopper.join(30)
    t.join(30)
    assert errors and "shutting down" in str(errors[0].value)
    with pytest.raises(RuntimeError, match="shutting down"):
        worker.ask("after", None, 1)


def test_call_runs_on_the_worker_between_chunks():
    memory = FakeMemory()
    memory.gate.set()
    worker, done = make_worker(memory)
    thread_names = []

    def snapshot(mem):
        thread_names.append(threading.current_thread().name)
        return len(mem.log)

    worker.submit_chunk(chunk(0))
    assert wait_until(lambda: done == [0])
    assert worker.call(snapshot, timeout_s=5) == 1
    assert thread_names == ["deltas_memory_worker"]
    def refuse(mem):
        raise ValueError("bad file")

    with pytest.raises(RuntimeError, match="bad file"):
        worker.call(refuse, timeout_s=5)
    worker.stop()


def test_a_failing_report_is_counted_and_the_worker_goes_on():
    memory = FakeMemory()
    memory.gate.set()
    reported = []

    def on_chunk(c, result):
        if c.index == 0:
            raise RuntimeError("publisher's context is invalid")
        reported.append(c.index)

    worker = MemoryWorker(memory, on_chunk, queue_chunks=4, poll_s=0.01)
    for i in range(2):
        worker.submit_chunk(chunk(i))
    assert wait_until(lambda: reported == [1])
    worker.stop()
    assert worker.counters.chunks_processed == 2 and worker.counters.reports_failed == 1
    assert "context is invalid" in worker.counters.last_error


def test_failures_are_counted_by_what_failed_and_caller_mistakes_are_not_failures():
    memory = FakeMemory()
    memory.gate.set()
    worker, _ = make_worker(memory)

    def disk_full(mem):
        raise OSError("No space left on device")

    with pytest.raises(RuntimeError, match="save failed: No space"):
        worker.call(disk_full, timeout_s=5, name="save")
    with pytest.raises(RuntimeError, match="empty"):
        worker.ask("", None, timeout_s=5)
    worker.stop()
    counters = worker.counters
    assert counters.failed == {"save": 1} and counters.questions_failed == 0
    assert counters.requests_refused == 1 and "save failed" in counters.last_error


def test_posted_operations_keep_their_place_and_coalesce():
    def autosave_twice(worker: MemoryWorker) -> None:
        assert worker.post(lambda mem: mem.log.append(("save",)), "autosave", coalesce=True)
        assert not worker.post(lambda mem: mem.log.append(("save",)), "autosave", coalesce=True)

    assert log_around(autosave_twice) == [("chunk", 0), ("save",), ("chunk", 1)]


def test_discarding_drops_waiting_chunks_only_and_counts_them():
    memory = FakeMemory()  # gate closed
    worker, done = make_worker(memory, queue=10)
    worker.submit_chunk(chunk(0))
    assert memory.busy.wait(5)
    worker.submit_chunk(chunk(1))
    worker.post(lambda memory: memory.reset(), "reset")
    worker.submit_chunk(chunk(2))
    assert worker.discard_chunks() == 2 and worker.queue_depth == 0
    memory.gate.set()
    assert wait_until(lambda: ("reset",) in memory.log)
    worker.stop()
    assert done == [0] and worker.counters.chunks_discarded == 2


def test_a_tiny_timeout_on_an_idle_worker_does_not_say_busy():
    memory = FakeMemory()
    memory.gate.set()
    worker, _ = make_worker(memory)
    started = threading.Event()

    def slow(mem):
        started.set()
        time.sleep(0.5)

    with pytest.raises(TimeoutError) as caught:
        worker.call(slow, timeout_s=0.1, name="save")
    assert "busy" not in str(caught.value) and "still running" in str(caught.value)
    assert started.is_set()
    memory.gate.clear()
    worker.submit_chunk(chunk(0))  # now busy with a chunk: that is what it says
    assert memory.busy.wait(5)
    with pytest.raises(TimeoutError, match="busy with"):
        worker.ask("anyone?", None, timeout_s=0.2)
    memory.gate.set()
    worker.stop()


def test_stop_releases_the_caller_of_the_request_in_progress():
    memory = FakeMemory()
    memory.gate.set()
    worker, _ = make_worker(memory)
    release, running, errors = threading.Event(), threading.Event(), []

    def long_question(mem):
        running.set()
        release.wait(30)

    caller = threading.Thread(target=lambda: errors.append(pytest.raises(
        RuntimeError, worker.call, long_question, 30, "ask_like")))
    caller.start()
    assert running.wait(5)
    assert not worker.stop(timeout_s=0.2)  # the item is still running
    caller.join(5)
    assert not caller.is_alive() and "shutting down" in str(errors[0].value)
    release.set()


def test_chunks_get_the_pose_at_their_stamp_and_questions_their_options():
    memory = FakeMemory()
    memory.gate.set()
    worker = MemoryWorker(memory, lambda c, r: None, poll_s=0.01,
                          pose_at=lambda stamp: f"pose at {stamp}")
    worker.submit_chunk(chunk(3))
    assert wait_until(lambda: memory.poses)
    assert worker.ask("where?", 4, 10.0, since=1.0, until=None) == "answer to where?"
    worker.stop()
    assert memory.poses == [(3.5, "pose at 3.5")]
    assert ("ask", "where?", {"since": 1.0, "until": None}) in memory.log


class GeneratingMemory(FakeMemory):
    """A question that decodes until `cancelled()` says stop (one token every 10 ms)."""

    def ask(self, question, max_new_tokens=None, cancelled=None, **options):
        self.busy.set()
        for tokens in range(3000):
            if cancelled():
                return f"cancelled after {tokens}"
            time.sleep(0.01)
        return "all 3000 tokens"


def test_cancelling_questions_stops_the_one_in_progress_and_refuses_the_waiting():
    memory = GeneratingMemory()
    worker, _ = make_worker(memory)
    answers, errors = [], []

    def ask(question: str) -> None:
        try:
            answers.append(worker.ask(question, None, 60))
        except RuntimeError as error:
            errors.append(str(error))

    askers = [threading.Thread(target=ask, args=(q,)) for q in ("first", "second")]
    askers[0].start()
    assert memory.busy.wait(5)
    askers[1].start()
    assert wait_until(lambda: worker.questions_waiting == 1)
    assert worker.cancel_questions("not active") == 2
    for asker in askers:
        asker.join(5)
    assert answers[0].startswith("cancelled after") and errors == ["not active"]
    worker.stop()


def test_stop_ends_a_question_at_its_next_token():
    """A 4096-token answer at shutdown: the worker thread must end, not stay inside the model
    (leaving the interpreter then aborted the process)."""
    memory = GeneratingMemory()
    worker, _ = make_worker(memory)
    threading.Thread(target=lambda: pytest.raises(RuntimeError, worker.ask, "long", None, 60),
                     daemon=True).start()
    assert memory.busy.wait(5)
    assert worker.stop(timeout_s=3.0) and not worker.alive
