"""Request bodies: JSON only, bounded in size and time, every field type-checked, so a
malformed request is a 4xx with its reason and never a traceback."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .dashboard_access import Refused
from .dashboard_limits import Limits

MAX_QUESTION_CHARS = 2000


@dataclass(frozen=True)
class Question:
    """A checked /ask request: the question and its stream-time window (0: open)."""

    text: str
    since: float
    until: float


async def read_json(request: web.BaseRequest, limits: Limits) -> dict[str, Any]:
    """The body as a JSON object. `Content-Type: application/json` is required: a cross-origin
    page can send text/plain or a form without asking first, never JSON."""
    if request.content_type != "application/json":
        raise Refused(415, "Content-Type must be application/json")
    if (request.content_length or 0) > limits.max_body:
        raise Refused(413, f"body over {limits.max_body} bytes")
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            body = await request.read()  # aiohttp stops at client_max_size
    except web.HTTPRequestEntityTooLarge as error:
        raise Refused(413, f"body over {limits.max_body} bytes") from error
    except TimeoutError as error:
        raise Refused(408, f"body not received within {limits.body_timeout_s:g} s") from error
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise Refused(400, f"body is not valid JSON: {type(error).__name__}") from error
    if not isinstance(data, dict):
        raise Refused(400, "body must be a JSON object")
    return data


def number(value: Any, name: str) -> float:
    """A finite, non-negative number (JSON's true/false are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(400, f"{name} must be a number")
    if not math.isfinite(value) or value < 0:
        raise Refused(400, f"{name} must be finite and not negative")
    return float(value)


def parse_question(data: dict[str, Any]) -> Question:
    """{"question": str, "window"?: [since, until] | null}; anything else is refused."""
    unknown = set(data) - {"question", "window"}
    if unknown:
        raise Refused(400, f"unknown fields: {sorted(unknown)}")
    text = data.get("question")
    if not isinstance(text, str):
        raise Refused(400, "question must be a string")
    text = text.strip()
    if not text or len(text) > MAX_QUESTION_CHARS:
        raise Refused(400, f"question must have 1 to {MAX_QUESTION_CHARS} characters")
    window = data.get("window")
    if window is None:
        return Question(text, 0.0, 0.0)
    if not isinstance(window, list) or len(window) != 2:
        raise Refused(400, "window must be a list of two numbers [since, until]")
    since, until = number(window[0], "window[0]"), number(window[1], "window[1]")
    if since and until and until < since:
        raise Refused(400, "window ends before it starts")
    return Question(text, since, until)
