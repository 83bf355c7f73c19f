"""The node's 1 Hz health report, from a session's counters: level, message and values.

WARN on what happened since the previous report, not forever after one dropped chunk or bad
frame; ERROR for ERROR_HOLD_S after a failed chunk or operation.

`report` takes the session itself (its type imported for checking only): it reads most of its
counters, its sampler, gate, worker and memory, and writes `at_last_report`, so a narrower
type would restate Session's attributes. Of the lifecycle it reads two facts: `ready` (the
session's) and `active` (the node's rclpy state, through the session).
"""

from __future__ import annotations

import enum
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .session import Session

ERROR_HOLD_S = 10.0  # diagnostics stay ERROR this long after a failed chunk or operation


class Level(enum.IntEnum):
    """diagnostic_msgs/DiagnosticStatus levels."""

    OK = 0
    WARN = 1
    ERROR = 2


def loading_health(values: dict[str, Any]) -> tuple[Level, str, dict[str, Any]]:
    """The diagnostics report while the model loads (also before autostart has a session)."""
    return Level.WARN, "loading the model", {"model": values["model_path"]}


def report(session: Session) -> tuple[Level, str, dict[str, Any]]:
    """Level, message and values of the 1 Hz diagnostics report of `session` (it remembers
    the counters of the previous report, `at_last_report`)."""
    if not session.ready:
        return loading_health(session.values)
    counters, sampler, worker = session.worker.counters, session.sampler, session.worker
    now, last = time.monotonic(), session.at_last_report
    bad = session.gate.bad_frames + session.callback_errors
    new_drops, new_bad = counters.chunks_dropped - last["drops"], bad - last["bad"]
    frames_per_s = sampler.received - last["frames"]
    session.at_last_report = {"frames": sampler.received, "drops": counters.chunks_dropped,
                              "bad": bad}
    latency = statistics.median(session.latencies_ms) if session.latencies_ms else 0.0
    seconds_per_chunk = session.values["frames_per_chunk"] / session.values["fps"]
    silent_s = now - (session.last_frame_wall or session.started_wall)
    queue_depth = worker.queue_depth
    level, message = Level.OK, "ok"
    if counters.last_error and now - counters.last_error_time < ERROR_HOLD_S:
        level, message = Level.ERROR, counters.last_error
    elif not session.active:
        level, message = Level.WARN, "inactive: camera intake stopped, memory kept"
    elif silent_s > session.values["silence_warn_s"]:
        level, message = Level.WARN, f"no camera frames for {silent_s:.0f} s"
    elif queue_depth >= session.values["queue_chunks"] or new_drops:
        level, message = Level.WARN, "model slower than real time: chunks dropped"
    elif new_bad:
        level, message = Level.WARN, f"bad frames: {session.gate.last_error}"
    stats, result, memory = session.stats, session.last_result, session.memory
    values = {
        "input_rate_hz": f"{frames_per_s:.1f}",
        "frames_received": sampler.received,
        "frames_sampled": sampler.sampled,
        "frames_dropped": sampler.dropped_frames,
        "frames_bad": session.gate.bad_frames,
        "callback_errors": session.callback_errors,
        "time_jumps_back": sampler.time_jumps_back,
        "time_gaps": sampler.time_gaps,
        "chunks_processed": counters.chunks_processed,
        "chunks_dropped": counters.chunks_dropped + session.chunks_before_ready,
        "chunks_discarded": counters.chunks_discarded,
        "chunks_failed": counters.chunks_failed,
        "reports_failed": counters.reports_failed,
        "questions_answered": counters.questions_answered,
        "questions_failed": counters.questions_failed,
        "questions_refused": session.questions_refused,
        "requests_refused": counters.requests_refused + session.requests_refused,
        "resets": session.resets,
        "saves_failed": counters.failed["save"] + counters.failed["jump_reset"],
        "reset_saves": session.reset_saves,
        "poses_refused": session.poses_refused,
        "loads_failed": counters.failed["load"],
        "resets_failed": counters.failed["reset"],
        "autosaves": session.autosaves,
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
