"""The node's session without ROS: the stream record taken on the worker, reset/save/load
atomic with the stream, autosave between chunks, refusals that are not failures, health rules.
Tiny model on CPU; frames pushed at 2 fps."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import wait_until

from deltas_ros.core.decode import FrameError
from deltas_ros.core.frames import SampledChunk
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.core.persistence import load_memory
from deltas_ros.runtime import params
from deltas_ros.runtime import session as session_module
from deltas_ros.runtime.files import MemoryFiles
from deltas_ros.runtime.health import Level
from deltas_ros.runtime.session import FRAME_ID_MAX, NOT_READY, Session
from deltas_ros.runtime.session_counters import LATENCY_WINDOW
from deltas_ros.runtime.stream_record import StreamRecord, continue_clock

BASE = 1_700_000_000.0
VALUES = params.defaults() | {"model_path": "/models/tiny", "pixel_budget": 4096,
                              "budget_tokens": 120, "window_tokens": 40, "max_new_tokens": 4}


def frame(stamp: float) -> np.ndarray:
    """A texture that changes every second of stamp time, 48x64 RGB."""
    return np.random.default_rng(int(stamp) % 1000).integers(0, 256, (48, 64, 3), np.uint8)


class Running:
    """A session with a worker over a fresh tiny memory, recording each chunk's report."""

    def __init__(self, tiny_model, directory: Path, key: bytes | None = None, **values) -> None:
        self.memory = StreamingMemory(tiny_model, params.memory_config(VALUES | values))
        self.session = Session(VALUES | values, MemoryFiles(directory), key=key)
        self.reports: list[tuple[int, float, float]] = []  # (index, stream time, drift)
        self.session.attach(self.memory, self._on_chunk)
        self.worker = self.session.worker

    def _on_chunk(self, chunk, result, held) -> None:
        """The session has recorded the chunk before it is published."""
        assert self.session.last_result is result and held == self.session.stats.held
        self.reports.append((chunk.index, result.time, result.drift))

    def push(self, start: float, seconds: float) -> None:
        """Frames at exactly 2 fps from `start`: one chunk per second."""
        for k in range(int(seconds * 2)):
            stamp = start + k / 2
            self.session.take_frame(stamp, lambda s=stamp: frame(s), "camera")

    def settle(self, reports: int) -> None:
        assert wait_until(lambda: len(self.reports) >= reports and not self.worker.queue_depth
                          and not self.worker.questions_waiting), self.reports

    def call(self, function):
        return self.worker.call(function, 60.0, "op")

    def close(self) -> None:
        self.worker.stop()


@pytest.fixture
def running(tiny_model, tmp_path):
    runs = []

    def make(key: bytes | None = None, **values) -> Running:
        runs.append(Running(tiny_model, tmp_path / "memory", key, **values))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


def reference_drift(tiny_model, stamps_start: float, seconds: int, time_of, path=None):
    """Drift of `seconds` chunks fed straight to a fresh memory (after loading `path`)."""
    memory = StreamingMemory(tiny_model, params.memory_config(VALUES))
    if path is not None:
        load_memory(memory, path)
    drift = []
    for c in range(seconds):
        stamps = [stamps_start + c, stamps_start + c + 0.5]
        drift.append(memory.add_chunk([frame(s) for s in stamps], [time_of(s) for s in stamps],
                                      stamp=stamps[-1]).drift)
    return drift


# ----------------------------------------------------------------------------- pure rules
def test_stream_record_round_trips_and_refuses_doctored_values():
    record = StreamRecord(BASE, BASE + 2.5, 3)
    assert StreamRecord.from_json(record.to_json()) == record
    assert StreamRecord.from_json({}) is None
    good = record.to_json()
    for bad in ({"stream_start": "0"}, {"last_stamp": math.nan}, {"last_stamp": math.inf},
                {"stream_start": BASE + 9}, {"stream_start": -1.0}, {"next_chunk_index": 2**40},
                {"next_chunk_index": True}, {"next_chunk_index": 1.0}, {"extra": 1}):
        with pytest.raises(ValueError):
            StreamRecord.from_json(good | bad)
    with pytest.raises(ValueError):
        StreamRecord.from_json([1, 2, 3])


def test_loading_continues_the_clock_and_never_jumps_back():
    record = StreamRecord(BASE, BASE + 2.5, 3)
    assert continue_clock(record, None, 0, 2.0) == (BASE, BASE + 2.5, 3)  # a restart
    # Same clock, later: a restarted camera (index 1) continues the file's indices; chunks made
    # after the save (index 9) keep theirs, so no index is published twice.
    assert continue_clock(record, BASE + 9.0, 1, 2.0) == (BASE, BASE + 9.0, 3)
    assert continue_clock(record, BASE + 9.0, 9, 2.0) == (BASE, BASE + 9.0, 9)
    start, last, index = continue_clock(record, 100.0, 9, 2.0)  # a clock behind the file's
    assert (last, index) == (100.0, 9)  # indices the live camera published are not given again
    assert continue_clock(record, 100.0, 1, 2.0)[2] == 3
    assert 100.0 + 0.5 - start == pytest.approx(2.5 + 1.0)  # next frame: one period on


def test_questions_are_refused_before_the_worker_and_counted_apart(tmp_path):
    session = Session(VALUES, MemoryFiles(tmp_path))
    assert session.question_refusal("hello", 0) == NOT_READY
    session.ready = True
    assert "not active" in session.question_refusal("hello", 0)
    session.node_active = lambda: True
    assert "empty" in session.question_refusal("  ", 0)
    assert "limit" in session.question_refusal("x" * 3000, 0)
    assert "limit 4096" in session.question_refusal("hello", 2**32 - 1)
    assert "limit 4096" in session.question_refusal("hello", 65535)
    assert session.question_refusal("hello", 4096) == ""
    assert session.counters.questions_refused == 6


def test_a_question_that_slips_past_a_deactivate_stops_at_its_first_token(running):
    """Accepted while active, served after the node left active (the deactivate's cancel ran
    in between): it stops at once, marked cancelled, as the one in progress then did."""
    run = running()
    session, checks = run.session, iter([True])
    session.node_active = lambda: next(checks, False)  # active for the refusal check only
    answer = session.ask("What did you see?", 4)
    assert answer.cancelled and answer.generated_tokens == 0
    session.node_active = lambda: True
    assert not session.ask("What did you see?", 4).cancelled


def test_chunks_before_ready_are_counted_and_frame_ids_are_bounded(tmp_path):
    session = Session(VALUES, MemoryFiles(tmp_path))
    for k in range(4):
        session.take_frame(BASE + k / 2, lambda: frame(BASE), "x" * 1_000_000)
    assert session.counters.chunks_before_ready == 2
    assert len(session.frame_id) == FRAME_ID_MAX


# ----------------------------------------------------------------------------- with a memory
def test_a_reset_discards_the_waiting_chunks_of_the_old_stream(running, tiny_model):
    """Finding 5: chunks queued before a reset never enter the new memory."""
    run = running()
    hold, holding = threading.Event(), threading.Event()

    def busy(memory) -> None:
        holding.set()
        hold.wait(60)

    run.worker.post(busy, "hold")  # the model is busy
    assert holding.wait(60)
    run.push(BASE, 3.0)
    assert wait_until(lambda: run.worker.queue_depth == 3)
    results = []
    resetting = threading.Thread(target=lambda: results.append(run.call(run.session.reset)))
    resetting.start()
    assert wait_until(lambda: run.worker.questions_waiting == 1)
    hold.set()
    resetting.join(60)
    assert results[0].discarded == 3 and results[0].chunks == 0
    assert run.reports == [] and run.worker.counters.chunks_discarded == 3
    run.push(BASE + 50, 2.0)  # the new stream
    run.settle(2)
    assert [r[0] for r in run.reports] == [0, 1]
    expected = reference_drift(tiny_model, BASE + 50, 2, lambda s: s - (BASE + 50))
    assert [r[2] for r in run.reports] == expected  # bit-identical to a fresh memory


def test_a_save_records_the_stream_the_memory_holds(running, tmp_path):
    """Finding 3: after a reset, a load or a restart the saved position is the memory's."""
    run = running()
    files = run.session.files
    run.push(BASE, 3.0)
    run.settle(3)
    run.call(lambda m: run.session.save(m, files.resolve("three")))
    assert run.session.record == StreamRecord(BASE, BASE + 2.5, 3)
    run.call(run.session.reset)
    saved = run.call(lambda m: run.session.save(m, files.resolve("empty")))
    assert saved.chunks == 0
    assert session_module.read_metadata(files.resolve("empty"))["extra"]["stream"] == {}
    run.call(lambda m: run.session.load(m, files.resolve("three")))
    run.call(lambda m: run.session.save(m, files.resolve("again")))
    extra = session_module.read_metadata(files.resolve("again"))["extra"]
    assert extra["stream"] == StreamRecord(BASE, BASE + 2.5, 3).to_json()

    # A restart: load before the worker exists, save before any frame.
    restarted = running()
    restarted.session.load(restarted.memory, files.resolve("three"))
    restarted.call(lambda m: restarted.session.save(m, files.resolve("restarted")))
    extra = session_module.read_metadata(files.resolve("restarted"))["extra"]
    assert extra["stream"] == StreamRecord(BASE, BASE + 2.5, 3).to_json()


def test_a_keyed_session_refuses_files_saved_without_its_key(running):
    """memory_key_file: a file saved under another key (or none) is refused, memory untouched."""
    keyed, other = running(key=b"k" * 32), running(key=b"x" * 32)
    keyed.push(BASE, 2.0)
    keyed.settle(2)
    path = keyed.session.files.resolve("keyed")
    keyed.call(lambda m: keyed.session.save(m, path))
    assert keyed.call(lambda m: keyed.session.load(m, path)).chunks == 2
    before = other.memory.export_state()
    with pytest.raises(RuntimeError, match="HMAC"):  # the worker reports it as the failure
        other.call(lambda m: other.session.load(m, path))
    assert other.memory.export_state().chunks_seen == before.chunks_seen == 0


@pytest.mark.parametrize("live_behind", [False, True])
def test_a_load_while_the_camera_streams_continues_without_wiping(running, tiny_model,
                                                                  live_behind):
    """Finding 4: the next live frame after a load is no jump back; the loaded memory goes on
    with the same drift as a memory that loaded the file and got the same frames."""
    source = running()
    source.push(BASE, 3.0)
    source.settle(3)
    path = source.session.files.resolve("three")
    source.call(lambda m: source.session.save(m, path))

    run = running()
    live = BASE - 100.0 if live_behind else BASE + 3.0
    run.push(live, 2.0)  # the live camera, on its own clock
    run.settle(2)
    loaded = run.call(lambda m: run.session.load(m, path))
    assert loaded.chunks == 3
    run.push(live + 2.0, 2.0)
    run.settle(4)
    sampler = run.session.sampler
    assert sampler.time_jumps_back == 0 and run.session.counters.resets == 0
    assert run.memory.chunks_seen == 5
    after = run.reports[2:]
    assert [r[0] for r in after] == [3, 4]  # the file's chunk indices go on
    times = [r[1] for r in after]
    assert times[0] > 2.5 and times == sorted(times)
    start = sampler.stream_start
    expected = reference_drift(tiny_model, live + 2.0, 2, lambda s: s - start, path)
    assert [r[2] for r in after] == expected


def test_a_load_after_more_chunks_of_the_same_stream_never_repeats_an_index(running,
                                                                          tiny_model):
    """The soak's save, then a chunk, then the load: the memory goes back to the file, and the
    stream goes on without publishing the chunk index it has already published."""
    run = running()
    run.push(BASE, 3.0)
    run.settle(3)
    path = run.session.files.resolve("three")
    run.call(lambda m: run.session.save(m, path))
    run.push(BASE + 3.0, 1.0)  # chunk 3: published, then undone by the load
    run.settle(4)
    assert run.call(lambda m: run.session.load(m, path)).chunks == 3
    run.push(BASE + 4.0, 2.0)
    run.settle(6)
    indices = [r[0] for r in run.reports]
    assert indices == [0, 1, 2, 3, 4, 5]
    assert run.memory.chunks_seen == 5  # the file's 3 and the 2 after the load
    expected = reference_drift(tiny_model, BASE + 4.0, 2, lambda s: s - BASE, path)
    assert [r[2] for r in run.reports[4:]] == expected


def test_autosave_runs_between_chunks_not_inside_the_report(running):
    run = running(autosave_chunks=2)
    default = run.session.files.default
    seen_in_report = []
    on_chunk = run.worker.on_chunk

    def report(chunk, result):
        on_chunk(chunk, result)
        seen_in_report.append(default.exists())

    run.worker.on_chunk = report
    run.push(BASE, 2.0)
    run.settle(2)
    assert seen_in_report == [False, False]  # the save was queued, not done in the report
    assert wait_until(lambda: run.session.counters.autosaves == 1)
    run.call(lambda m: None)  # after the autosave
    extra = session_module.read_metadata(default)["extra"]
    assert extra["stream"] == StreamRecord(BASE, BASE + 1.5, 2).to_json()


def test_failures_are_named_and_client_mistakes_do_not_turn_error(running, monkeypatch):
    run = running()
    session = run.session
    session.question_refusal("", 0)
    with pytest.raises(RuntimeError, match="no memory file"):
        run.worker.call(lambda m: session.load(m, session.files.resolve("absent")), 60, "load")
    level, _, values = session.health()
    assert level is not Level.ERROR
    assert values["questions_refused"] == 1 and values["requests_refused"] == 1
    assert values["loads_failed"] == 0 and values["questions_failed"] == 0

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session_module, "save_memory", disk_full)
    with pytest.raises(RuntimeError, match="save failed: .*No space"):
        run.worker.call(lambda m: session.save(m, session.files.default), 60, "save")
    level, message, values = session.health()
    assert level is Level.ERROR and "save failed" in message
    assert values["saves_failed"] == 1 and values["questions_failed"] == 0


def test_health_warns_on_what_happened_since_the_last_report(running, tmp_path):
    """The 1 Hz diagnostics rules without DDS: each WARN names its cause and clears at the next
    report once the cause is gone; silence and inactivity hold while they last."""
    level, message, _ = Session(VALUES, MemoryFiles(tmp_path / "m")).health()
    assert (level, message) == (Level.WARN, "loading the model")
    run = running(silence_warn_s=3600.0)
    session = run.session
    session.node_active = lambda: True
    run.push(BASE, 2)
    run.settle(2)
    assert session.health()[:2] == (Level.OK, "ok")

    def bad_frame() -> np.ndarray:
        raise FrameError("unsupported encoding '16UC1'")

    session.take_frame(BASE + 2.0, bad_frame, "camera")
    level, message, values = session.health()
    assert level is Level.WARN and "16UC1" in message and values["frames_bad"] == 1
    assert session.health()[:2] == (Level.OK, "ok")  # nothing new since

    run.worker.counters.chunks_dropped += 1  # what the worker counts when its queue overflows
    assert session.health()[:2] == (Level.WARN, "model slower than real time: chunks dropped")
    assert session.health()[0] is Level.OK

    session.node_active = lambda: False
    assert session.health()[:2] == (Level.WARN, "inactive: camera intake stopped, memory kept")
    session.node_active = lambda: True
    session.values = session.values | {"silence_warn_s": 0.01}
    session.counters.last_frame_wall = time.monotonic() - 5
    level, message, _ = session.health()
    assert level is Level.WARN and message.startswith("no camera frames for")


def test_health_reports_the_second_tier_only_when_one_is_configured(running, tmp_path):
    """tier_* values: what each tier holds and what it dropped, with a second tier only; the
    disk tier's files are in memory_dir/tiers."""
    plain = running()
    plain.push(BASE, 1)
    plain.settle(1)
    assert not [name for name in plain.session.health()[2] if name.startswith("tier_")]
    run = running(host_budget_mb=0.002, disk_budget_mb=1.0, recall_tokens=64,
                  memory_dir=str(tmp_path / "memory"))
    run.push(BASE, 8)
    run.settle(8)
    assert run.memory.tiers.flush(10.0)
    values = run.session.health()[2]
    stats = run.memory.tiers.current_stats()
    assert values["tier_disk_chunks"] >= 1 and values["tier_disk_bytes"] > 0
    assert {name: value for name, value in values.items() if name.startswith("tier_")} == {
        "tier_host_chunks": stats.host_chunks, "tier_host_bytes": stats.host_bytes,
        "tier_disk_chunks": stats.disk_chunks, "tier_disk_bytes": stats.disk_bytes,
        "tier_summary_bytes": stats.summary_bytes, "tier_dropped_pieces": 0,
        "tier_dropped_chunks": 0}
    assert stats.summary_bytes > 0
    assert len(list((tmp_path / "memory" / "tiers").glob("chunk-*.safetensors"))) == \
        stats.disk_chunks
    assert values["kv_tokens"] <= VALUES["budget_tokens"]


def test_latency_is_the_median_of_the_last_chunks(running):
    """chunk_latency_ms: median over the last LATENCY_WINDOW chunks (forward + signal +
    eviction), so one slow chunk neither hides nor lingers; real_time_factor per chunk second."""
    run = running()
    session = run.session
    run.push(BASE, 1)
    run.settle(1)
    result = session.last_result
    assert result is not None

    def done(ms: float) -> None:
        session.chunk_done(SampledChunk(0, [], [BASE, BASE + 0.5], [0.0, 0.5]),
                           replace(result, forward_ms=ms, signal_ms=0.0, evict_ms=0.0))

    for _ in range(LATENCY_WINDOW):
        done(10.0)
    done(1000.0)  # one slow chunk: the median stays
    values = session.health()[2]
    assert values["chunk_latency_ms"] == "10.0"
    assert values["real_time_factor"] == f"{10.0 / 1e3 / 1.0:.3f}"  # 2 frames at 2 fps: 1 s
    for _ in range(LATENCY_WINDOW // 2 + 1):
        done(40.0)  # the window moves on: the newer half decides
    assert session.health()[2]["chunk_latency_ms"] == "40.0"


# ----------------------------------------------------------------------------- lifecycle
def test_configure_refuses_with_a_reason_and_open_close_loads_and_frees(tiny_model_dir, tmp_path):
    """Lifecycle configure without ROS: bad values and a missing model are refused with the
    reason; open_memory loads the model; close stops the worker and lets go of the memory."""
    values = VALUES | {"model_path": str(tiny_model_dir), "memory_dir": str(tmp_path)}
    with pytest.raises(ValueError, match="budget_tokens"):
        Session.configure(values | {"budget_tokens": 10})
    with pytest.raises(FileNotFoundError, match="no model at"):
        Session.configure(values | {"model_path": str(tmp_path / "none")})
    session = Session.configure(values)
    memory, problem = session.open_memory()
    assert problem == "" and memory.chunks_seen == 0
    session.attach(memory, lambda chunk, result: None)
    assert session.ready and session.question_refusal("hello", 0) == session_module.NOT_ACTIVE
    ended, freed = session.close(5.0)
    assert ended and not session.ready and session.memory is None and session.worker is None
    assert "rss" in freed


def push_slowly(run: Running, start: float, seconds: float, pause_s: float) -> None:
    """As Running.push, with `pause_s` of wall time between frames (arrival time)."""
    for k in range(int(seconds * 2)):
        stamp = start + k / 2
        run.session.take_frame(stamp, lambda s=stamp: frame(s), "camera")
        time.sleep(pause_s)


def test_a_jump_back_saves_the_memory_before_resetting_it(running, tiny_model):
    run = running(timeline_confirm_s=0.1)
    run.push(BASE + 100, 3.0)
    run.settle(3)
    push_slowly(run, BASE, 2.0, pause_s=0.06)  # a bag looped: its frames keep coming
    run.settle(5)
    assert [r[0] for r in run.reports] == [0, 1, 2, 0, 1]
    _, _, values = run.session.health()
    assert values["resets"] == 1 and values["reset_saves"] == 1 and values["saves_failed"] == 0
    saved = run.session.files.root / "before-reset-0.safetensors"
    restored = StreamingMemory(tiny_model, params.memory_config(VALUES))
    load_memory(restored, saved)
    assert restored.chunks_seen == 3  # what the reset forgot, loadable


def test_a_failed_save_before_a_reset_still_resets_and_counts_as_a_failed_save(running,
                                                                             monkeypatch):
    run = running(timeline_confirm_s=0.1)
    run.push(BASE + 100, 2.0)
    run.settle(2)

    def refused(*args, **kwargs):
        raise ValueError("Out of range float values are not JSON compliant")

    monkeypatch.setattr(session_module, "save_memory", refused)
    push_slowly(run, BASE, 2.0, pause_s=0.06)
    run.settle(4)
    level, message, values = run.session.health()
    assert [r[0] for r in run.reports] == [0, 1, 0, 1] and values["resets"] == 1
    assert values["saves_failed"] == 1 and values["requests_refused"] == 0
    assert level is Level.ERROR and "before a time-jump reset failed" in message


def test_a_save_that_fails_to_write_is_a_failed_save_not_a_refusal(running, monkeypatch):
    """A memory the JSON encoder refuses once counted as the caller's mistake."""
    run = running()
    run.push(BASE, 1.0)
    run.settle(1)

    def refused(*args, **kwargs):
        raise ValueError("Out of range float values are not JSON compliant")

    monkeypatch.setattr(session_module, "save_memory", refused)
    with pytest.raises(RuntimeError, match="cannot write the memory"):
        run.worker.call(lambda m: run.session.save(m, run.session.files.default), 60, "save")
    _, _, values = run.session.health()
    assert values["saves_failed"] == 1 and values["requests_refused"] == 0
