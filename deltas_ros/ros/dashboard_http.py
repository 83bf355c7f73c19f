"""The dashboard's HTTP side (no rclpy here, so it is tested without ROS): aiohttp on its own
event loop in its own thread, serving the page, the state, its Server-Sent Events and questions.

Every request passes dashboard_access's rules first; every bound is in dashboard_limits. A
question runs in a small thread pool (the node's ask blocks until its result); its feedback comes
back through loop.call_soon_threadsafe, coalesced to the latest (each feedback holds the whole
answer so far), so neither a slow browser nor a closed one reaches rclpy's executor.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from .dashboard_access import Access, Refused
from .dashboard_body import Question, parse_question, read_json
from .dashboard_server import BoundedServer
from .dashboard_state import DashboardState, Subscriber, sse

PAGE = Path(__file__).with_name("dashboard.html")
# The page's own scripts (dashboard*.js beside it), inlined where the page names them.
SCRIPT = re.compile(rb'<script src="(dashboard[a-z_]*\.js)"></script>')
STREAM_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-store"}

# ask(question, on_feedback, left) -> result dict: blocks until the goal ends; when `left` is
# set (the client went away) it cancels its goal and returns. cancel() -> bool.
AskFn = Callable[[Question, Callable[[dict], None], threading.Event], dict]


def page_html() -> bytes:
    """The page with its scripts inlined: one request, and no script URL has to carry the
    token (the page passes it on to what its script requests)."""
    return SCRIPT.sub(lambda m: b"<script>\n" + PAGE.with_name(m[1].decode()).read_bytes()
                      + b"</script>", PAGE.read_bytes())


def refusal(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status,
                             headers={"Cache-Control": "no-store"})


class DashboardHttp:
    """The dashboard's server: start() runs it on a thread of its own, stop() ends it."""

    def __init__(self, state: DashboardState, host: str, port: int, token: str = "",
                 ask: AskFn | None = None, cancel: Callable[[], bool] | None = None,
                 allow_hosts: tuple[str, ...] = ()) -> None:
        self.access = Access(host, token, allow_hosts)
        self.state, self.limits = state, state.limits
        self.host, self.port = host, port
        self.ask_fn, self.cancel_fn = ask, cancel
        self.asks = 0  # questions whose thread is still busy (touched on the loop only)
        self.pool = ThreadPoolExecutor(self.limits.max_asks, thread_name_prefix="dashboard-ask")
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.runner: web.ServerRunner | None = None
        self.thread = threading.Thread(target=self._run, name="dashboard-http", daemon=True)
        self.routes = {("GET", "/"): self.page, ("GET", "/state"): self.snapshot,
                       ("GET", "/memory.jpg"): self.image, ("GET", "/events"): self.events,
                       ("POST", "/ask"): self.ask, ("POST", "/cancel"): self.cancel}

    def start(self) -> int:
        """Serve; the bound port once listening (port 0: an ephemeral one)."""
        self.thread.start()
        self.ready.wait()
        if self.failure is not None:
            raise self.failure
        return self.port

    def stop(self) -> None:
        if self.runner is not None and self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._listen())
        except BaseException as error:  # noqa: BLE001 - handed to start()'s caller
            self.failure = error
            self.ready.set()
            return
        self.ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _listen(self) -> None:
        server = BoundedServer(self.handle, self.limits, lingering_time=0, max_line_size=4096,
                               max_field_size=4096, max_headers=32, access_log=None)
        self.runner = web.ServerRunner(server, shutdown_timeout=2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self.state.loop = self.loop

    async def _close(self) -> None:
        """End the streams (they would hold the shutdown), then the server."""
        self.state.loop = None
        for subscriber in self.state.subscribers:
            subscriber.end()
        await self.runner.cleanup()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request: the access rules, then its route; a refusal is JSON with a reason."""
        try:
            self.access.check(request)
            route = self.routes.get((request.method, request.path))
            if route is None:
                known = any(path == request.path for _, path in self.routes)
                raise Refused(405 if known else 404,
                              "method not allowed" if known else "not found")
            return await route(request)
        except Refused as refused:
            return refusal(refused.status, refused.reason)

    async def page(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=page_html(), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def snapshot(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.json_response(self.state.snapshot(), headers={"Cache-Control": "no-store"})

    async def image(self, request: web.BaseRequest) -> web.StreamResponse:
        with self.state.lock:
            image, stamp = self.state.image, self.state.image_stamp
        if not image:
            raise Refused(404, "no memory image yet")
        # The stamp as /state's held["stamp"] spells it (repr: the same float back in JSON).
        return web.Response(body=image, content_type="image/jpeg",
                            headers={"Cache-Control": "no-store",
                                     "X-Memory-Stamp": repr(stamp)})

    async def _stream(self, request: web.BaseRequest) -> web.StreamResponse:
        """An event stream's response, sent; its connection closes when the stream ends."""
        response = web.StreamResponse(headers=STREAM_HEADERS)
        response.force_close()
        await response.prepare(request)
        return response

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        """One write; a client that takes longer than the write timeout is dropped."""
        async with asyncio.timeout(self.limits.write_timeout_s):
            await response.write(data)

    async def events(self, request: web.BaseRequest) -> web.StreamResponse:
        subscriber = self.state.subscribe()
        response = web.StreamResponse()
        try:
            response = await self._stream(request)
            await self._send(response, sse("state", self.state.snapshot()))
            while (event := await self._next(subscriber)) is not None:
                await self._send(response, event)
        except (ConnectionError, TimeoutError):
            pass  # the client left or stalled: only its own stream ends
        finally:
            self.state.unsubscribe(subscriber)
        return response

    async def _next(self, subscriber: Subscriber) -> bytes | None:
        """The next event, a comment after ping_s of silence, None when the stream must end."""
        try:
            async with asyncio.timeout(self.limits.ping_s):
                return await subscriber.queue.get()
        except TimeoutError:
            return b": keepalive\n\n"

    async def ask(self, request: web.BaseRequest) -> web.StreamResponse:
        question = parse_question(await read_json(request, self.limits))
        if self.ask_fn is None:
            raise Refused(503, "no ask action")
        if self.asks >= self.limits.max_asks:
            raise Refused(429, f"{self.limits.max_asks} questions are already in flight")
        latest: list[dict] = []
        changed = asyncio.Event()

        def feedback(data: dict) -> None:  # on an rclpy thread: hand over, never raise
            try:
                self.loop.call_soon_threadsafe(
                    lambda: (latest.clear(), latest.append(data), changed.set()))
            except RuntimeError:  # the loop closed: the dashboard is stopping
                pass

        left = threading.Event()
        self.asks += 1
        future = self.loop.run_in_executor(self.pool, self.ask_fn, question, feedback, left)
        future.add_done_callback(lambda _: (setattr(self, "asks", self.asks - 1),
                                            changed.set()))
        response = web.StreamResponse()
        try:
            response = await self._stream(request)
            while not future.done():
                await changed.wait()
                changed.clear()
                if latest:
                    await self._send(response, sse("feedback", latest[-1]))
                    latest.clear()
            await self._send(response, sse("result", future.result()))
        except (ConnectionError, TimeoutError):
            pass  # the client left or stalled: only its own request ends
        finally:
            left.set()  # before the result, this cancels the client's own goal
        return response

    async def cancel(self, request: web.BaseRequest) -> web.StreamResponse:
        await read_json(request, self.limits)
        return web.json_response({"cancelled": bool(self.cancel_fn and self.cancel_fn())})
