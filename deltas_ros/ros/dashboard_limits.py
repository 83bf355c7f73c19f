"""Every bound the dashboard's HTTP side keeps, in one place: a browser, a script or an attacker
on this machine can hold at most this much of the dashboard, and never any of the memory node.
Tests shorten the timeouts; the defaults suit a page on a robot's network."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The dashboard server's bounds (counts, bytes, seconds)."""

    max_connections: int = 64  # open TCP connections; at the cap an idle one gives way
    max_subscribers: int = 8  # /events streams; at the cap the oldest gives way
    max_asks: int = 4  # questions in flight (each holds one thread while its goal runs)
    max_body: int = 4096  # request body bytes (aiohttp's client_max_size)
    idle_timeout_s: float = 30.0  # a connection not inside a request: headers must come by then
    body_timeout_s: float = 10.0  # to receive a whole request body
    write_timeout_s: float = 10.0  # a stream write that waits longer drops its client
    ping_s: float = 15.0  # an /events comment when nothing happened, to notice a gone client
    queue_events: int = 256  # events waiting for one /events client; beyond, it is dropped
    chunks: int = 600  # chunks kept for /state
    evictions: int = 200  # evicting chunks kept for /state
