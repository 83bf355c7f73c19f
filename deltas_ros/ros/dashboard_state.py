"""What the dashboard knows (bounded) and who listens to it.

The data is written by rclpy's executor threads and read by the HTTP loop, under one lock. The
/events subscribers belong to the HTTP loop alone: a change reaches them through
loop.call_soon_threadsafe, so an rclpy callback never waits for, or fails with, a browser.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from typing import Any

from .dashboard_limits import Limits

TIERED = ("tiered_time", "tiered_tokens", "tiered_tier")  # ~/memory_chunks' second tier


def sse(kind: str, data: Any) -> bytes:
    """One Server-Sent Event."""
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


class Subscriber:
    """One /events stream: its events in order, or None once it must end."""

    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=size)

    def offer(self, event: bytes) -> bool:
        """Queue an event; False when the client is too far behind to catch up."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            return False
        return True

    def end(self) -> None:
        """Make its stream end now, whatever it has not sent yet."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class DashboardState:
    """Bounded snapshot of what the memory node published, plus the /events subscribers."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.lock = threading.Lock()
        self.chunks: deque[dict] = deque(maxlen=self.limits.chunks)
        self.evictions: deque[dict] = deque(maxlen=self.limits.evictions)
        self.health: dict[str, Any] = {}
        self.image: bytes = b""
        self.image_stamp = 0.0  # the stamp of the chunk after which the image was drawn
        self.held: dict[str, list] = {}  # the node's latest ~/memory_chunks, as arrays
        self.loop: asyncio.AbstractEventLoop | None = None  # the HTTP loop, once it runs
        self.subscribers: list[Subscriber] = []  # oldest first; touched on the loop only

    def add_chunk(self, chunk: dict) -> None:
        with self.lock:
            self.chunks.append(chunk)
            if chunk.get("evicted_tokens", 0) > 0:
                self.evictions.append(chunk)
        self.publish("chunk", chunk)

    def set_health(self, health: dict) -> None:
        with self.lock:
            self.health = health
        self.publish("health", health)

    def set_image(self, jpeg: bytes, stamp: float = 0.0) -> None:
        with self.lock:
            self.image, self.image_stamp = jpeg, stamp
        self.publish("image", {"bytes": len(jpeg), "stamp": stamp})

    def set_held(self, held: dict[str, list]) -> None:
        """What the memory holds now (one entry per chunk: bounded by the node's budget), and
        the newest of its second tier, as many as the timeline keeps chunks (the tier on disk
        may hold many more than the page shows)."""
        keep = self.limits.chunks
        held = held | {name: held[name][-keep:] for name in TIERED if name in held}
        with self.lock:
            self.held = held
        self.publish("held", held)

    def snapshot(self) -> dict:
        with self.lock:
            return {"chunks": list(self.chunks), "evictions": list(self.evictions),
                    "health": dict(self.health), "image": bool(self.image),
                    "held": dict(self.held)}

    def publish(self, kind: str, data: Any) -> None:
        """From any thread: hand the event to the HTTP loop, never waiting for it."""
        loop = self.loop
        if loop is None or not self.subscribers:
            return
        try:
            loop.call_soon_threadsafe(self.fan_out, sse(kind, data))
        except RuntimeError:  # the loop closed: the dashboard is stopping
            pass

    def fan_out(self, event: bytes) -> None:
        """On the loop: every subscriber gets the event; one too far behind is ended (its
        browser reconnects and starts again from a snapshot) instead of slowing the rest."""
        for subscriber in list(self.subscribers):
            if not subscriber.offer(event):
                self.unsubscribe(subscriber)
                subscriber.end()

    def subscribe(self) -> Subscriber:
        """On the loop: a new subscriber; at the cap the oldest one gives way, so a page opened
        now always gets its live view (idle streams cannot lock it out)."""
        while len(self.subscribers) >= self.limits.max_subscribers:
            self.subscribers.pop(0).end()
        subscriber = Subscriber(self.limits.queue_events)
        self.subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self.subscribers:
            self.subscribers.remove(subscriber)
