"""Helpers for the dashboard's HTTP tests: raw-socket requests (the library clients would
normalize what the tests send on purpose), a dashboard HTTP server in a process of its own (to
count its threads), a headless chromium, and a fake memory node's ~/ask action.

Not a test module; run as a script it is that server process:
`python test/dashboard_helpers.py '{"idle_timeout_s": 1}'` prints its port and serves until
killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from ros_helpers import stop

from bench.dashboard_page import dashboard_url

REPO = Path(__file__).resolve().parents[1]


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response's status, headers (lower-case names) and body (Content-Length or until
    the connection closes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in
               (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes as they are, read one response."""
    with connect(port) as sock:
        sock.sendall(raw)
        return read_response(sock)


def post(port: int, path: str, body: bytes, *headers: str) -> tuple[int, dict]:
    """A POST with exactly these header lines (Host and Content-Length added); status, JSON."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
             "Connection: close", *filter(None, headers)]
    status, _, reply = request(port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return status, json.loads(reply) if status >= 400 else {"body": reply.decode()}


def open_events(port: int, *headers: str, path: str = "/events") -> socket.socket:
    """An event stream requested by hand; nothing of it read yet."""
    sock = connect(port)
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def closed(sock: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset), without waiting; what it sent
    before is read and dropped."""
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def threads(pid: int) -> int:
    """How many threads a process runs now."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:"))
               .split()[1])


def start_server_process(limits: dict) -> tuple[subprocess.Popen, int]:
    """This file as a script: a dashboard HTTP server with these limits; its process and port."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    process = subprocess.Popen([sys.executable, __file__, json.dumps(limits)], env=env,
                               stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.strip().isdigit():
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, int(line)


def dashboard_process(ros_env: dict, *args: str, **env: str) -> subprocess.Popen:
    """`deltas-ros dashboard --port 0 ARGS` (no memory node needed to serve)."""
    environ = dict(ros_env, **env,
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "deltas_ros.tools.cli", "dashboard",
                             "--port", "0", *args], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def served_port(process: subprocess.Popen) -> int:
    url = dashboard_url(process)
    assert url.startswith("http://127.0.0.1:"), url
    return urlsplit(url).port


def stop_dashboard(process: subprocess.Popen) -> str:
    """SIGTERM, as a launch file stops it; its stderr."""
    return stop(process, signal.SIGTERM)[1]


def chromium():
    """A headless chromium driven by selenium; the test skips where it is not installed."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))


class SlowMemory:
    """A memory node's ~/ask action that answers slowly, one feedback every 0.1 s for up to
    60 s, and records whether a goal was cancelled: a page can be closed mid-answer. The
    question "quick" is answered at once. Its diagnostics (twice a second, HEALTH) let a test
    see that a page gets live events."""

    HEALTH = "slow memory alive"

    def __init__(self, node_name: str = "deltas_memory") -> None:
        import rclpy
        from deltas_ros.action import AskMemory
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from rclpy.action import ActionServer, CancelResponse
        from rclpy.executors import MultiThreadedExecutor

        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(node_name, context=self.context)
        self.goals = 0
        self.cancelled = threading.Event()
        self.server = ActionServer(self.node, AskMemory, "~/ask", execute_callback=self._execute,
                                   cancel_callback=lambda _goal: CancelResponse.ACCEPT)
        publisher = self.node.create_publisher(DiagnosticArray, "/diagnostics", 10)
        status = DiagnosticStatus(name=f"{node_name}: memory", message=self.HEALTH)
        self.node.create_timer(0.5, lambda: publisher.publish(DiagnosticArray(status=[status])))
        self.executor = MultiThreadedExecutor(num_threads=4, context=self.context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _execute(self, goal_handle):
        from deltas_ros.action import AskMemory

        self.goals += 1
        words = []
        for _ in range(0 if goal_handle.request.question == "quick" else 600):
            if goal_handle.is_cancel_requested:
                self.cancelled.set()
                goal_handle.canceled()
                return AskMemory.Result(success=False, message="cancelled")
            words.append("red")
            goal_handle.publish_feedback(AskMemory.Feedback(answer=" ".join(words),
                                                            tokens=len(words)))
            time.sleep(0.1)
        goal_handle.succeed()
        return AskMemory.Result(success=True, answer=" ".join(words))

    def close(self) -> None:
        import rclpy

        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self.thread.join(5)


def main() -> None:
    from deltas_ros.ros.dashboard_http import DashboardHttp
    from deltas_ros.ros.dashboard_limits import Limits
    from deltas_ros.ros.dashboard_state import DashboardState

    def ask(question, on_feedback, left) -> dict:
        on_feedback({"answer": "a red", "tokens": 2})
        return {"success": True, "answer": question.text}

    state = DashboardState(Limits(**json.loads(sys.argv[1])))
    print(DashboardHttp(state, "127.0.0.1", 0, ask=ask).start(), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
