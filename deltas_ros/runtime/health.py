"""The node's 1 Hz health report, from a session's counters: level, message and values.

WARN on what happened since the previous report, not forever after one dropped chunk or bad
frame; ERROR for ERROR_HOLD_S after a failed chunk or operation.

`report` reads the session's counters (`SessionCounters`, where it also keeps what the previous
report saw), its gate, worker and memory; the session calls it once the model is loaded. Of the
lifecycle it reads one fact: `active` (the node's rclpy state, through the session).
"""

from __future__ import annotations

import enum
import statistics
import time
from typing import Any

from ..core.frames import FrameGate
from ..core.memory import ChunkResult, MemoryStats, StreamingMemory
from .session_counters import SessionCounters
from .worker import MemoryWorker

ERROR_HOLD_S = 10.0  # diagnostics stay ERROR this long after a failed chunk or operation


class Level(enum.IntEnum):
    """diagnostic_msgs/DiagnosticStatus levels."""

    OK = 0
    WARN = 1
    ERROR = 2


def loading_health(values: dict[str, Any]) -> tuple[Level, str, dict[str, Any]]:
    """The diagnostics report while the model loads (also before autostart has a session)."""
    return Level.WARN, "loading the model", {"model": values["model_path"]}


def report(counters: SessionCounters, values: dict[str, Any], *, active: bool, gate: FrameGate,
           worker: MemoryWorker, memory: StreamingMemory, stats: MemoryStats,
           result: ChunkResult | None) -> tuple[Level, str, dict[str, Any]]:
    """Level, message and values of the 1 Hz diagnostics report of a loaded session: its
    `counters` (it remembers those of the previous report, `at_last_report`), its
    parameter `values`, whether the node is `active`, its frame gate, worker and memory (`stats`
    and the latest chunk's `result` as the worker last left them)."""
    work, sampler = worker.counters, gate.sampler
    now, last = time.monotonic(), counters.at_last_report
    bad = gate.bad_frames + counters.callback_errors
    new_drops, new_bad = work.chunks_dropped - last["drops"], bad - last["bad"]
    frames_per_s = sampler.received - last["frames"]
    counters.at_last_report = {"frames": sampler.received, "drops": work.chunks_dropped,
                               "bad": bad}
    latency = statistics.median(counters.latencies_ms) if counters.latencies_ms else 0.0
    seconds_per_chunk = values["frames_per_chunk"] / values["fps"]
    silent_s = now - (counters.last_frame_wall or counters.started_wall)
    queue_depth = worker.queue_depth
    level, message = Level.OK, "ok"
    if work.last_error and now - work.last_error_time < ERROR_HOLD_S:
        level, message = Level.ERROR, work.last_error
    elif not active:
        level, message = Level.WARN, "inactive: camera intake stopped, memory kept"
    elif silent_s > values["silence_warn_s"]:
        level, message = Level.WARN, f"no camera frames for {silent_s:.0f} s"
    elif queue_depth >= values["queue_chunks"] or new_drops:
        level, message = Level.WARN, "model slower than real time: chunks dropped"
    elif new_bad:
        level, message = Level.WARN, f"bad frames: {gate.last_error}"
    return level, message, {
        "input_rate_hz": f"{frames_per_s:.1f}",
        "frames_received": sampler.received,
        "frames_sampled": sampler.sampled,
        "frames_dropped": sampler.dropped_frames,
        "frames_bad": gate.bad_frames,
        "callback_errors": counters.callback_errors,
        "time_jumps_back": sampler.time_jumps_back,
        "time_gaps": sampler.time_gaps,
        "chunks_processed": work.chunks_processed,
        "chunks_dropped": work.chunks_dropped + counters.chunks_before_ready,
        "chunks_discarded": work.chunks_discarded,
        "chunks_failed": work.chunks_failed,
        "reports_failed": work.reports_failed,
        "questions_answered": work.questions_answered,
        "questions_failed": work.questions_failed,
        "questions_refused": counters.questions_refused,
        "requests_refused": work.requests_refused + counters.requests_refused,
        "resets": counters.resets,
        "saves_failed": work.failed["save"] + work.failed["jump_reset"],
        "reset_saves": counters.reset_saves,
        "poses_refused": counters.poses_refused,
        "loads_failed": work.failed["load"],
        "resets_failed": work.failed["reset"],
        "autosaves": counters.autosaves,
        "autosaves_failed": work.failed["autosave"],
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
    } | tier_values(memory)


def tier_values(memory: StreamingMemory) -> dict[str, int]:
    """The second tier's chunks and bytes in host memory and on disk, its key summaries' host
    bytes, and what it lost (pieces the writer fell behind on, chunks dropped past both
    budgets); none without a second tier."""
    if memory.tiers is None:
        return {}
    stats = memory.tiers.current_stats()
    return {"tier_host_chunks": stats.host_chunks, "tier_host_bytes": stats.host_bytes,
            "tier_disk_chunks": stats.disk_chunks, "tier_disk_bytes": stats.disk_bytes,
            "tier_summary_bytes": stats.summary_bytes,
            "tier_dropped_pieces": stats.dropped_pieces,
            "tier_dropped_chunks": stats.dropped_chunks}
