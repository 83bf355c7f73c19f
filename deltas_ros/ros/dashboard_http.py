"""The dashboard's HTTP side: bounded state and a stdlib server (no rclpy here, so it is tested
without ROS). Stdlib only: robots are often offline and the memory node never imports this."""

from __future__ import annotations

import ipaddress
import json
import queue
import threading
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

MAX_BODY = 4096
MAX_CLIENTS = 8
CHUNKS = 600
EVICTIONS = 200
SOCKET_TIMEOUT_S = 30.0
PAGE = Path(__file__).with_name("dashboard.html")

# ask(question, since, until, on_feedback) -> result dict; cancel() -> bool.
AskFn = Callable[[str, float, float, Callable[[dict], None]], dict]


def is_loopback(host: str) -> bool:
    """True for a host only this machine can reach (the safe default)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str) -> None:
    """Refuse to serve the memory beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise ValueError(f"host {host} is not loopback: give --token to serve it")


class DashboardState:
    """Bounded snapshot of what the memory node published, plus the SSE subscribers."""

    def __init__(self, chunks: int = CHUNKS, max_clients: int = MAX_CLIENTS) -> None:
        self.lock = threading.Lock()
        self.chunks: deque[dict] = deque(maxlen=chunks)
        self.evictions: deque[dict] = deque(maxlen=EVICTIONS)
        self.health: dict[str, Any] = {}
        self.image: bytes = b""
        self.held: dict[str, list] = {}  # the node's latest ~/memory_chunks, as arrays
        self.max_clients = max_clients
        self.clients: list[queue.Queue] = []

    def add_chunk(self, chunk: dict) -> None:
        with self.lock:
            self.chunks.append(chunk)
            if chunk.get("evicted_tokens", 0) > 0:
                self.evictions.append(chunk)
        self.push("chunk", chunk)

    def set_health(self, health: dict) -> None:
        with self.lock:
            self.health = health
        self.push("health", health)

    def set_image(self, jpeg: bytes) -> None:
        with self.lock:
            self.image = jpeg
        self.push("image", {"bytes": len(jpeg)})

    def set_held(self, held: dict[str, list]) -> None:
        """What the memory holds now (one entry per chunk: bounded by the node's budget)."""
        with self.lock:
            self.held = held
        self.push("held", held)

    def snapshot(self) -> dict:
        with self.lock:
            return {"chunks": list(self.chunks), "evictions": list(self.evictions),
                    "health": dict(self.health), "image": bool(self.image),
                    "held": dict(self.held)}

    def subscribe(self) -> queue.Queue | None:
        """A queue of events, or None when MAX_CLIENTS already listen (bounded cost)."""
        with self.lock:
            if len(self.clients) >= self.max_clients:
                return None
            q: queue.Queue = queue.Queue(maxsize=256)
            self.clients.append(q)
            return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self.lock:
            if q in self.clients:
                self.clients.remove(q)

    def push(self, kind: str, data: dict) -> None:
        with self.lock:
            clients = list(self.clients)
        for q in clients:
            try:
                q.put_nowait((kind, data))
            except queue.Full:  # a stalled browser loses events, never blocks the node
                pass


def sse(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def make_handler(state: DashboardState, token: str, ask: AskFn | None,
                 cancel: Callable[[], bool] | None) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to this state, token and ask/cancel calls."""

    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT_S
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
            pass

        def _authorized(self) -> bool:
            if not token:
                return True
            query = parse_qs(urlparse(self.path).query)
            given = self.headers.get("X-Token") or query.get("token", [""])[0]
            return given == token

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, data: Any) -> None:
            self._send(code, json.dumps(data).encode())

        def _start_stream(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802 - stdlib's name
            if not self._authorized():
                return self._json(401, {"error": "token required"})
            path = urlparse(self.path).path
            if path == "/":
                return self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
            if path == "/state":
                return self._json(200, state.snapshot())
            if path == "/memory.jpg":
                with state.lock:
                    image = state.image
                if not image:
                    return self._json(404, {"error": "no memory image yet"})
                return self._send(200, image, "image/jpeg")
            if path == "/events":
                return self._events()
            self._json(404, {"error": "not found"})

        def _events(self) -> None:
            q = state.subscribe()
            if q is None:
                return self._json(503, {"error": "too many clients"})
            try:
                self._start_stream()
                self.wfile.write(sse("state", state.snapshot()))
                while True:
                    try:
                        kind, data = q.get(timeout=15)
                        self.wfile.write(sse(kind, data))
                    except queue.Empty:
                        self.wfile.write(b": keepalive\n\n")
                    self.wfile.flush()
            except OSError:
                pass
            finally:
                state.unsubscribe(q)

        def do_POST(self) -> None:  # noqa: N802 - stdlib's name
            if not self._authorized():
                return self._json(401, {"error": "token required"})
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self.close_connection = True
                return self._json(413, {"error": f"body over {MAX_BODY} bytes"})
            body = self.rfile.read(length) if length else b""
            path = urlparse(self.path).path
            if path == "/cancel":
                return self._json(200, {"cancelled": bool(cancel and cancel())})
            if path != "/ask":
                return self._json(404, {"error": "not found"})
            try:
                request = json.loads(body or b"{}")
                question = str(request["question"]).strip()
                window = request.get("window") or [0.0, 0.0]
                since, until = float(window[0]), float(window[1])
            except (ValueError, KeyError, TypeError, IndexError):
                return self._json(400, {"error": "expected {question, window?: [since, until]}"})
            if not question or ask is None:
                return self._json(400, {"error": "empty question or no ask action"})
            self._start_stream()
            try:
                result = ask(question, since, until,
                             lambda fb: (self.wfile.write(sse("feedback", fb)),
                                         self.wfile.flush()))
                self.wfile.write(sse("result", result))
                self.wfile.flush()
            except OSError:
                pass

    return Handler


def make_server(state: DashboardState, host: str, port: int, token: str = "",
                ask: AskFn | None = None,
                cancel: Callable[[], bool] | None = None) -> ThreadingHTTPServer:
    """A threading HTTP server on host:port (port 0: an ephemeral one), after the token rule."""
    check_bind(host, token)
    server = ThreadingHTTPServer((host, port), make_handler(state, token, ask, cancel))
    server.daemon_threads = True
    return server
