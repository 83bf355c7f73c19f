"""A callback group that bounds how many service callbacks run at once."""

from __future__ import annotations

import threading
from typing import Any

from rclpy.callback_groups import CallbackGroup


class BoundedCallbackGroup(CallbackGroup):
    """Callbacks run in parallel, but at most `limit` at once; the rest wait in their queue.

    While the group is full its entities leave the executor's wait set, so nothing spins.
    """

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.running, self._lock = limit, 0, threading.Lock()

    def can_execute(self, entity: Any) -> bool:
        with self._lock:
            return self.running < self.limit

    def beginning_execution(self, entity: Any) -> bool:
        with self._lock:
            if self.running < self.limit:
                self.running += 1
                return True
        return False

    def ending_execution(self, entity: Any) -> None:
        with self._lock:
            self.running -= 1
