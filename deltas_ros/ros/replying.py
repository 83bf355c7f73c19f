"""A guard that turns any exception of a service callback into a failed reply."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def replying(name: str, callback: Callable[[Any, Any], Any],
             failed: Callable[[str, Exception], str]) -> Callable[[Any, Any], Any]:
    """Service callback(request, response) whose exceptions become a failed reply: success
    false, `message` (and `error` where the type has it) what failed(name, error) says (it
    counts and logs). An exception left to the executor would end the node and its memory."""

    @functools.wraps(callback)
    def guarded(request: Any, response: Any) -> Any:
        try:
            return callback(request, response)
        except Exception as error:  # anything: the node must answer and go on
            response.success = False
            response.message = failed(name, error)
            if hasattr(response, "error"):
                response.error = response.message
            return response

    return guarded
