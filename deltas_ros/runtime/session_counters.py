"""What a session counts and times for its health report: written by the session (camera,
worker and executor threads), read by `health.report`, which also keeps here what the previous
report saw. Its own object, so health reads it without knowing the session."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

LATENCY_WINDOW = 30  # chunks in the latency median


@dataclass(eq=False)
class SessionCounters:
    """The session's counts; `lock` guards those counted from several threads."""

    callback_errors: int = 0
    chunks_before_ready: int = 0
    questions_refused: int = 0  # client mistakes refused before reaching the worker
    requests_refused: int = 0
    autosaves: int = 0
    resets: int = 0  # worker thread only
    reset_saves: int = 0  # memories saved before a time jump reset them (worker thread)
    poses_refused: int = 0  # pose messages refused at the subscription
    started_wall: float = field(default_factory=time.monotonic)
    last_frame_wall: float = 0.0  # time.monotonic() of the last camera frame (0: none yet)
    # forward + signal + evict ms of the latest chunks
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    # What the previous health report saw: the report is of what happened since.
    at_last_report: dict[str, int] = field(
        default_factory=lambda: {"frames": 0, "drops": 0, "bad": 0})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
