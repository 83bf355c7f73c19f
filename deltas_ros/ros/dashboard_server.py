"""aiohttp's low-level server with the bounds it leaves to its user: a cap on open connections
and a deadline for a connection that is not inside a request (aiohttp waits for a first request
line forever, so a slowloris would hold its connections), and malformed requests answered as
JSON without a traceback. No thread per connection: asyncio holds them all on one loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from .dashboard_limits import Limits

LOG = logging.getLogger("deltas_dashboard")
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class JsonErrors(web.RequestHandler):
    """aiohttp's connection handler, answering what its parser refuses (a bad Content-Length,
    an overlong header, ...) with the status and reason as JSON; no traceback is logged."""

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            LOG.error("error answering a request", exc_info=exc)
            message = "internal error"
        if request.writer.output_size > 0:  # a stream was under way: nothing more to say
            raise ConnectionError("response already sent")
        # The parser's message, without the excerpt of the request it appends on further lines.
        reason = (message or HTTPStatus(status).phrase).split("\n")[0].rstrip(": ")
        response = web.json_response({"error": reason}, status=status)
        response.force_close()
        return response


class BoundedServer(web.Server):
    """At most `max_connections` open; a connection outside a request for `idle_timeout_s`
    (headers still trickling in, or kept alive and unused) is closed. At the cap the oldest such
    connection gives way to the newcomer; when every one is inside a request (bounded by the
    stream and ask caps), the newcomer is closed."""

    def __init__(self, handler: Handler, limits: Limits, **kwargs: Any) -> None:
        super().__init__(self._tracked, handler_cancellation=True,
                         request_factory=self._make_bounded_request, **kwargs)
        self.handle = handler
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.handler_args = kwargs
        # Every open connection, oldest first, with its idle deadline (None: inside a request).
        self.idle: dict[web.RequestHandler, asyncio.TimerHandle | None] = {}

    def __call__(self) -> web.RequestHandler:
        return JsonErrors(self, loop=self.loop, **self.handler_args)

    def _make_bounded_request(self, *args: Any) -> web.BaseRequest:
        """aiohttp's request, reading at most max_body bytes of body."""
        return web.BaseRequest(*args, loop=self.loop, client_max_size=self.limits.max_body)

    def connection_made(self, handler: web.RequestHandler,
                        transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if len(self.idle) >= self.limits.max_connections:
            resting = next((h for h, timer in self.idle.items() if timer is not None), None)
            if resting is None:
                handler.force_close()
                return
            self._close(resting)
        self.idle[handler] = None
        self._rest(handler)

    def connection_lost(self, handler: web.RequestHandler,
                        exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        timer = self.idle.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _rest(self, handler: web.RequestHandler) -> None:
        """Outside a request from now: closed unless a request begins within the timeout."""
        if handler in self.idle:
            self.idle[handler] = self.loop.call_later(self.limits.idle_timeout_s,
                                                      self._close, handler)

    def _close(self, handler: web.RequestHandler) -> None:
        timer = self.idle.pop(handler, None)
        if timer is not None:
            timer.cancel()
        handler.force_close()

    async def _tracked(self, request: web.BaseRequest) -> web.StreamResponse:
        """The handler, with its connection marked as inside a request while it runs."""
        handler = request.protocol
        timer = self.idle.get(handler)
        if timer is not None:
            timer.cancel()
            self.idle[handler] = None
        try:
            return await self.handle(request)
        finally:
            self._rest(handler)
