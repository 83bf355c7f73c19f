"""`deltas-ros dashboard` beside the node under test, with one page open on it.

Why: the dashboard is meant to cost the memory node nothing beyond the topics it already
publishes; end_to_end --dashboard measures that, so the dashboard must be loaded as a user loads
it: a browser reading /events and fetching /memory.jpg on every image event, as dashboard.html
does.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter

from deltas_ros.core.config import DEFAULT_NODE

from .common import REPO, stop_process


def dashboard_url(process: subprocess.Popen, timeout: float = 120.0) -> str:
    """The URL `deltas-ros dashboard` prints once it serves (text-mode stdout). Lines before it
    are skipped: Jazzy's Fast DDS prints its transport errors (a shared-memory port it could
    not lock) on stdout. RuntimeError, the process killed, when none comes within `timeout`."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:  # till the process's end of output, or its pipe closed by a stop
        try:
            for line in process.stdout:
                lines.put(line)
        except (ValueError, OSError):
            pass

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if process.poll() is not None and lines.empty():
                break
            continue
        if line.startswith("dashboard: http://"):
            return line.split()[-1].rstrip("/")
        seen.append(line)
    process.kill()
    _, err = process.communicate(timeout=30)
    raise RuntimeError(f"the dashboard printed no URL: {''.join(seen[-5:])}{err[-2000:]}")


class DashboardPage:
    """The dashboard process (started as the launch file starts it, on a free port) and one
    /events reader on a thread, counting what it receives."""

    def __init__(self, node: str = DEFAULT_NODE, ready_timeout: float = 120.0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deltas_ros.tools.cli", "dashboard", "--node", node,
             "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        self.url = dashboard_url(self.process, ready_timeout)
        self.pid = self.process.pid
        self._wait_for_health(ready_timeout)
        self.events: Counter[str] = Counter()
        self.images_fetched = 0
        self.stream = urllib.request.urlopen(f"{self.url}/events", timeout=60)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _wait_for_health(self, timeout: float) -> None:
        """Until the dashboard has the node's diagnostics: its subscriptions are matched."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.url}/state", timeout=10) as response:
                if json.loads(response.read())["health"]:
                    return
            time.sleep(0.2)
        raise RuntimeError("the dashboard never saw the node's diagnostics")

    def _read(self) -> None:
        """What the page does: parse the stream, fetch the memory image on each image event."""
        kind = ""
        try:
            for raw in self.stream:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event: "):
                    kind = line.removeprefix("event: ")
                elif not line and kind:
                    self.events[kind] += 1
                    if kind == "image":
                        with urllib.request.urlopen(f"{self.url}/memory.jpg", timeout=10) as r:
                            r.read()
                        self.images_fetched += 1
                    kind = ""
        except (OSError, ValueError):
            pass  # the dashboard stopped

    def close(self) -> str:
        """Stop the dashboard and its reader; the dashboard's stderr."""
        err = stop_process(self.process)
        # The dashboard's exit ends the stream, so the reader sees its end and returns; closing
        # the stream under it first raced http.client's readline (an exception in the thread).
        self.thread.join(10)
        self.stream.close()
        return err
