"""The dashboard's HTTP side under attack, each probe as an attacker on this machine sent it
(raw sockets: a library client would normalize the request), on loopback only.

Most probes run against a DashboardHttp in this process with short timeouts; the slowloris runs
against one in a process of its own, whose threads are counted. The token's sources and the
command-line warning run `deltas-ros dashboard` itself (rclpy, no memory node needed)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest
from dashboard_helpers import (
    closed,
    connect,
    dashboard_process,
    open_events,
    post,
    read_response,
    request,
    served_port,
    start_server_process,
    stop_dashboard,
    threads,
)
from engine_helpers import wait_until

from deltas_ros.ros.dashboard_http import DashboardHttp
from deltas_ros.ros.dashboard_limits import Limits
from deltas_ros.ros.dashboard_state import DashboardState

QUESTION = json.dumps({"question": "What did you see?"}).encode()
JSON = "Content-Type: application/json"


class Asks:
    """A fake node's ask: answers at once, or streams until its client leaves (`slow`)."""

    def __init__(self) -> None:
        self.left: list[str] = []
        self.answered: list[str] = []
        self.cancels = 0

    def __call__(self, question, on_feedback, left: threading.Event) -> dict:
        on_feedback({"answer": "a red", "tokens": 2})
        if question.text.startswith("slow"):
            for step in range(400):
                if left.wait(0.05):
                    self.left.append(question.text)
                    return {"success": False, "message": "the client left"}
                on_feedback({"answer": "a red" * step, "tokens": step})
        self.answered.append(question.text)
        return {"success": True, "answer": "a red cube", "evidence_times": [1.0]}

    def cancel(self) -> bool:
        self.cancels += 1
        return True


@pytest.fixture
def dashboard(caplog):
    """A dashboard HTTP server on an ephemeral loopback port with short timeouts; yields
    (port, state, asks). Nothing may be logged at ERROR (a traceback) while it serves."""
    caplog.set_level(logging.INFO)
    state = DashboardState(Limits(idle_timeout_s=5.0, ping_s=0.5))
    asks = Asks()
    server = DashboardHttp(state, "127.0.0.1", 0, ask=asks, cancel=asks.cancel,
                           allow_hosts=("robot.local",))
    port = server.start()
    yield port, state, asks
    server.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def get(port: int, path: str, *headers: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Connection: close", *headers]
    status, _, body = request(port, ("\r\n".join(lines) + "\r\n\r\n").encode())
    return status, body


def reason(status_and_body: tuple[int, dict]) -> tuple[int, str]:
    status, body = status_and_body
    return status, body.get("error", "")


def test_content_length_negative_or_not_a_number_is_a_400_with_a_reason(dashboard):
    port, _, asks = dashboard
    for value in ("-1", "abc", "1e3", "+4"):
        status, headers, body = request(port, (
            f"POST /ask HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\nContent-Length: {value}\r\n"
            "\r\n").encode() + QUESTION)
        assert status == 400 and "Content-Length" in json.loads(body)["error"], (value, body)
        assert headers["content-type"].startswith("application/json")
    # 3000 levels of JSON nesting do not fit in the 4 KB a body may have.
    status, error = reason(post(port, "/ask", b"[" * 3000 + b"]" * 3000, JSON))
    assert status == 413 and "4096" in error
    # A body declared over the limit is refused from its header, not read (300 MB).
    with connect(port) as sock:
        sock.sendall(f"POST /ask HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\n"
                     "Content-Length: 300000000\r\n\r\n".encode() + b"[" * 1000)
        status, _, body = read_response(sock)
        assert status == 413 and "4096" in json.loads(body)["error"]
        assert wait_until(lambda: closed(sock), 10)
    assert not asks.answered


def test_a_foreign_host_is_refused_the_local_names_are_served(dashboard):
    port, _, _ = dashboard
    status, body = get(port, "/state", host="evil.example")
    assert status == 403 and "evil.example" in json.loads(body)["error"]
    for host in ("evil.example:80", "127.0.0.1.evil.example", "", "[::1"):
        assert get(port, "/state", host=host)[0] == 403, host
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}",
                 "robot.local"):  # robot.local: --allow-host
        assert get(port, "/state", host=host)[0] == 200, host
    assert get(port, "/", host="evil.example")[0] == 403
    assert get(port, "/events", host="evil.example")[0] == 403


def test_a_foreign_origin_can_neither_ask_nor_cancel(dashboard):
    port, _, asks = dashboard
    for origin in ("http://evil.example", "null", f"http://evil.example:{port}",
                   f"http://localhost:{port}"):  # Host says 127.0.0.1: another origin
        assert reason(post(port, "/ask", QUESTION, JSON, f"Origin: {origin}"))[0] == 403
        assert reason(post(port, "/cancel", b"{}", JSON, f"Origin: {origin}"))[0] == 403
    assert not asks.answered and asks.cancels == 0
    lines = ("Host: 127.0.0.1", f"Origin: http://127.0.0.1:{port}")
    status, _, body = request(port, (
        f"POST /cancel HTTP/1.1\r\n{lines[0]}:{port}\r\n{lines[1]}\r\n{JSON}\r\n"
        "Content-Length: 2\r\nConnection: close\r\n\r\n{}").encode())
    assert status == 200 and json.loads(body) == {"cancelled": True}  # the page's own origin
    assert post(port, "/ask", QUESTION, JSON)[0] == 200  # no Origin: not a browser page


def test_a_cross_origin_simple_request_is_refused(dashboard):
    """What a foreign page can send without a CORS preflight: text/plain, a form, no type."""
    port, _, asks = dashboard
    for ctype in ("Content-Type: text/plain", "Content-Type: text/plain;charset=UTF-8",
                  "Content-Type: application/x-www-form-urlencoded",
                  "Content-Type: multipart/form-data; boundary=x", ""):
        status, error = reason(post(port, "/ask", QUESTION, ctype))
        assert status == 415 and "application/json" in error, ctype
        assert reason(post(port, "/cancel", b"", ctype))[0] == 415
    status, _ = post(port, "/ask", QUESTION, "Content-Type: text/plain",
                     "Origin: http://evil.example")
    assert status == 403
    assert not asks.answered and asks.cancels == 0


@pytest.mark.parametrize(("body", "says"), [
    (b"[" * 2000 + b"]" * 2000, "not valid JSON"),  # nested past Python's recursion limit
    (b'{"question": {"text": "what?"}}', "question must be a string"),
    (b'{"question": ["what?"]}', "question must be a string"),
    (b'{"question": 42}', "question must be a string"),
    (b'{"question": "   "}', "1 to 2000 characters"),
    (b'{"question": "' + b"w" * 2001 + b'"}', "1 to 2000 characters"),
    (b'{}', "question must be a string"),
    (b'["what?"]', "JSON object"),
    (b'"what?"', "JSON object"),
    (b"{'question': 'what?'}", "not valid JSON"),
    (b'{"question": "what?"', "not valid JSON"),
    (b'{"question": "\xff\xfe"}', "not valid JSON"),
    (b'{"question": "what?", "window": [1]}', "two numbers"),
    (b'{"question": "what?", "window": "1-2"}', "two numbers"),
    (b'{"question": "what?", "window": {"since": 1}}', "two numbers"),
    (b'{"question": "what?", "window": ["1", 2]}', "window[0] must be a number"),
    (b'{"question": "what?", "window": [true, 2]}', "window[0] must be a number"),
    (b'{"question": "what?", "window": [1, NaN]}', "finite"),
    (b'{"question": "what?", "window": [1, Infinity]}', "finite"),
    (b'{"question": "what?", "window": [1, 1e400]}', "finite"),
    (b'{"question": "what?", "window": [-1, 2]}', "not negative"),
    (b'{"question": "what?", "window": [5, 2]}', "ends before"),
    (b'{"question": "what?", "max_new_tokens": 5}', "unknown fields"),
])
def test_a_malformed_body_is_a_400_with_its_reason(dashboard, body, says):
    port, _, asks = dashboard
    status, error = reason(post(port, "/ask", body, JSON))
    assert status == 400 and says in error, (status, error)
    assert not asks.answered


def test_a_well_formed_question_with_a_window_is_answered(dashboard):
    port, _, asks = dashboard
    for window in ("[1.5, 20]", "[0, 0]", "null", "[3, 0]"):
        body = b'{"question": "what?", "window": ' + window.encode() + b"}"
        status, reply = post(port, "/ask", body, JSON)
        assert status == 200 and "event: result" in reply["body"], window
    assert len(asks.answered) == 4


def sse_events(sock: socket.socket, wanted: str, timeout: float = 20.0) -> str:
    """Read an event stream until `wanted` appears in it (bounded)."""
    sock.settimeout(timeout)
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted.encode() not in seen and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        seen += chunk
    return seen.decode(errors="replace")


def test_an_events_flood_does_not_lock_out_a_page(dashboard):
    port, state, _ = dashboard
    cap = state.limits.max_subscribers
    flood = [open_events(port) for _ in range(cap + 4)]  # idle: they never read
    try:
        assert wait_until(lambda: len(state.subscribers) == cap, 20)
        page = open_events(port)
        assert "event: state" in sse_events(page, "event: state")
        state.add_chunk({"index": 7, "stream_time": 7.0, "drift": 0.1, "kv_tokens": 10,
                         "evicted_tokens": 0})
        assert '"index": 7' in sse_events(page, '"index": 7')
        assert len(state.subscribers) == cap  # the oldest gave way; still bounded
        # The oldest five streams were ended and their connections closed.
        assert wait_until(lambda: sum(closed(sock) for sock in flood) == 5, 20)
    finally:
        for sock in flood:
            sock.close()


def test_a_stalled_events_client_is_dropped_the_others_keep_up():
    """A client that stops reading fills its queue and is dropped; a page reading along gets
    every event. In lockstep (one event, then the page reads it) and by queue length, not by
    a timeout: nothing here depends on how fast a loaded machine is."""
    state = DashboardState(Limits(queue_events=16, write_timeout_s=30.0))
    server = DashboardHttp(state, "127.0.0.1", 0)
    port = server.start()
    stalled = connect(port)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    page = open_events(port)
    try:
        assert "event: state" in sse_events(page, "event: state")
        assert wait_until(lambda: len(state.subscribers) == 2, 20)
        pad, seen = "x" * 100_000, b""
        for i in range(200):  # 20 MB: far beyond what the stalled socket and queue hold
            state.add_chunk({"index": i, "pad": pad})
            marker = f'"index": {i},'.encode()
            deadline = time.monotonic() + 30
            while marker not in seen and time.monotonic() < deadline:
                seen = seen[-200_000:] + page.recv(1 << 20)
            assert marker in seen, i
        assert len(state.subscribers) == 1  # the stalled one is gone, the page is not
    finally:
        stalled.close()
        page.close()
        server.stop()


def test_a_client_leaving_mid_answer_ends_only_its_own_question(dashboard):
    port, _, asks = dashboard
    leaving = connect(port)
    body = b'{"question": "slow one"}'
    leaving.sendall(f"POST /ask HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert "event: feedback" in sse_events(leaving, "event: feedback")
    staying = connect(port)
    body = b'{"question": "slow two"}'
    staying.sendall(f"POST /ask HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert "event: feedback" in sse_events(staying, "event: feedback")
    leaving.close()
    try:
        assert wait_until(lambda: asks.left == ["slow one"], 20), asks.left
        assert "event: feedback" in sse_events(staying, "event: feedback")  # still streaming
        assert post(port, "/ask", QUESTION, JSON)[0] == 200  # and new questions are answered
    finally:
        staying.close()
    assert wait_until(lambda: sorted(asks.left) == ["slow one", "slow two"], 20)


def test_the_token_is_required_on_every_request_the_events_too():
    state = DashboardState(Limits(idle_timeout_s=1.0, ping_s=0.5))
    server = DashboardHttp(state, "127.0.0.1", 0, token="s3cret", ask=Asks())
    port = server.start()
    try:
        for path in ("/", "/state", "/events", "/memory.jpg", "/nowhere"):
            assert get(port, path)[0] == 401, path
            assert get(port, path + "?token=wrong")[0] == 401, path
            assert get(port, path, "X-Token: wrong")[0] == 401, path
        assert reason(post(port, "/ask", QUESTION, JSON))[0] == 401
        assert reason(post(port, "/cancel", b"{}", JSON))[0] == 401
        assert get(port, "/state?token=s3cret")[0] == 200
        assert get(port, "/", "X-Token: s3cret")[0] == 200
        events = open_events(port, path="/events?token=s3cret")  # as the page's EventSource
        assert "event: state" in sse_events(events, "event: state")
        events.close()
        assert post(port, "/ask?token=s3cret", QUESTION, JSON)[0] == 200
    finally:
        server.stop()


@pytest.mark.slow
def test_a_slowloris_holds_no_threads_and_its_connections_are_closed():
    """400 half-open connections, then 50 sending their headers a byte at a time: the server's
    thread count does not move, it never holds more than its cap, a real request is still
    answered, and every one of them is closed by the idle timeout (1 s here)."""
    process, port = start_server_process({"idle_timeout_s": 1.0, "max_connections": 64})
    half_open, trickling = [], []
    try:
        assert get(port, "/state")[0] == 200
        baseline = threads(process.pid)
        for _ in range(400):
            half_open.append(sock := connect(port))
            try:
                sock.sendall(b"GET /state HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                pass  # already closed (the cap or the timeout): as the test wants
        assert threads(process.pid) <= baseline
        assert get(port, "/state")[0] == 200  # at the cap, a half-open one gave way
        header = b"GET /state HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100
        trickling = [connect(port) for _ in range(50)]
        for k in range(len(header)):  # up to ~12 s of trickling, past the 1 s timeout
            for sock in trickling:
                try:
                    sock.sendall(header[k:k + 1])
                except OSError:
                    pass  # closed by the server: what this test waits for
            if all(closed(s) for s in trickling):
                break
            time.sleep(0.1)
        assert threads(process.pid) <= baseline
        everyone = half_open + trickling
        assert wait_until(lambda: all(closed(s) for s in everyone), 30), \
            sum(not closed(s) for s in everyone)
        assert get(port, "/state")[0] == 200
    finally:
        for sock in half_open + trickling:
            sock.close()
        process.kill()
        process.wait(10)


@pytest.mark.ros
@pytest.mark.slow
@pytest.mark.parametrize("source", ["file", "environment"])
def test_the_token_from_a_file_or_the_environment(source, ros_env, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    if source == "file":
        process, token = dashboard_process(ros_env, "--token-file", str(token_file)), \
            "from-a-file"
    else:
        process, token = dashboard_process(ros_env, DELTAS_DASHBOARD_TOKEN="from-the-env"), \
            "from-the-env"
    try:
        port = served_port(process)
        assert get(port, "/events")[0] == 401
        assert get(port, "/state")[0] == 401
        assert get(port, f"/state?token={token}")[0] == 200
        events = open_events(port, path=f"/events?token={token}")
        assert "event: state" in sse_events(events, "event: state")
        events.close()
    finally:
        err = stop_dashboard(process)
    assert "warning" not in err and token not in err


@pytest.mark.ros
@pytest.mark.slow
def test_a_token_on_the_command_line_works_with_a_warning(ros_env):
    process = dashboard_process(ros_env, "--token", "on-the-line")
    try:
        port = served_port(process)
        assert get(port, "/state")[0] == 401
        assert get(port, "/state", "X-Token: on-the-line")[0] == 200
    finally:
        err = stop_dashboard(process)
    assert "warning: --token is readable by every user" in err and "--token-file" in err


@pytest.mark.ros
@pytest.mark.slow
def test_a_port_in_use_is_a_one_line_error(ros_env):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        done = subprocess.run([sys.executable, "-m", "deltas_ros.tools.cli", "dashboard",
                               "--port", str(taken.getsockname()[1])], env=ros_env,
                              capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 2, done.stderr
    assert "cannot serve on 127.0.0.1" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("encoding, step", [("mono8", 4), ("rgba8", 16), ("rgb8", 6)])
def test_a_memory_image_the_dashboard_cannot_read_is_refused_not_raised_into_the_node(
        encoding, step):
    from sensor_msgs.msg import Image

    from deltas_ros.ros.dashboard import jpeg_of

    with pytest.raises(ValueError):  # the node's callback logs it and keeps the last strip
        jpeg_of(Image(height=2, width=4, encoding=encoding, step=step, data=bytes(2 * step)))
    good = Image(height=2, width=4, encoding="rgb8", step=12, data=bytes(24))
    assert jpeg_of(good)[:2] == b"\xff\xd8"
