"""The node process at its edges: a reliable camera of large frames with default parameters,
SIGINT/SIGTERM at any moment (imports, model load, a question, after lifecycle transitions,
the exit after `shutdown`), and start-up refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from deltas_ros.srv import AskMemory
from rclpy.task import Future
from ros_helpers import (
    PREFIX,
    StderrLog,
    Tester,
    make_slow_loading_model,
    raw_frame,
    start,
    status_values,
    stop,
    wait_future,
)
from sensor_msgs.msg import Image


@pytest.fixture
def ros_domain(ros_env, tmp_path, monkeypatch) -> dict[str, str]:
    """ros_env with Fast DDS's default transports (as on a robot) and memory_dir in tmp_path."""
    monkeypatch.delenv("FASTDDS_BUILTIN_TRANSPORTS")
    monkeypatch.setenv("ROS_HOME", str(tmp_path / "ros_home"))
    return dict(os.environ)


def vga_frame(i: int, stamp: float) -> Image:
    """640x480 rgb8 (0.9 MB): the size a best-effort subscription lost from a reliable camera."""
    msg = raw_frame(i, stamp)
    pixels = np.resize(np.frombuffer(msg.data, np.uint8), 480 * 640 * 3)
    msg.height, msg.width, msg.step, msg.data = 480, 640, 640 * 3, pixels.tobytes()
    return msg


def test_a_reliable_camera_of_large_frames_is_received_with_default_parameters(
        tiny_model_dir, ros_domain):
    """Default reliable_qos (false): the node follows the camera's reliable publisher, even one
    that appears after the node subscribed, and 640x480 frames arrive (no LARGE_DATA here)."""
    assert "FASTDDS_BUILTIN_TRANSPORTS" not in ros_domain
    process = start(tiny_model_dir, ros_domain)  # the camera is not there yet
    tester = None
    try:
        tester = Tester()  # its publisher: reliable (rclpy's default)
        tester.wait_ready(process)
        tester.stream(3.0, fps=10.0, make=vga_frame)
        tester.wait_for(lambda: len(tester.drift) >= 2, timeout=120)
    finally:
        if tester is not None:
            tester.close()
        code, err = stop(process)
    assert code == 0, err[-3000:]
    assert "(Image, reliable QoS)" in err


def wait_for_line(process: subprocess.Popen, text: str, timeout_s: float = 120.0) -> list[str]:
    """stderr lines until one contains `text` (read on a thread: readline can block)."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout_s), f"no {text!r} in: {''.join(lines)[-3000:]}"
    return lines


def exit_after(process: subprocess.Popen, sig: int) -> tuple[int, float, str]:
    """(return code, seconds from the signal to the exit, the rest of stderr)."""
    sent = time.monotonic()
    code, err = stop(process, sig)
    return code, time.monotonic() - sent, err


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory) -> Path:
    """A model that takes seconds to load (ros_helpers.make_slow_loading_model)."""
    return make_slow_loading_model(tmp_path_factory.mktemp("models") / "deep")


@pytest.mark.parametrize("sig,delay_s", [(signal.SIGINT, 0.0), (signal.SIGINT, 0.5),
                                         (signal.SIGTERM, 0.2)])
def test_a_signal_while_the_model_loads_exits_0_quickly(slow_model_dir, ros_domain, sig,
                                                        delay_s):
    """Once aborted with rc -6 ("terminate called without an active exception") 2 times in 5.
    The signal comes after the node says it is loading the model, and the node never says the
    load ended: the signal landed inside from_pretrained, on the loader thread."""
    process = start(slow_model_dir, ros_domain)
    before = wait_for_line(process, "loading the model from")  # load_model is being called
    time.sleep(delay_s)  # different moments of the load; any is fine
    code, seconds, err = exit_after(process, sig)
    assert code == 0 and "terminate called" not in err and "Traceback" not in err, err[-3000:]
    assert seconds < 15.0  # a few seconds; generous for a loaded CI machine
    log = "".join(before) + err
    assert "configured:" not in log and "listening to" not in log, log[-3000:]


def ask_a_long_answer(tester: Tester, process: subprocess.Popen) -> Future:
    """Once the node is ready, a 4096-token question asked; returns while its answer is being
    written (the node's `serving` is "ask")."""
    tester.wait_ready(process)
    future = tester.ask_client.call_async(AskMemory.Request(question="describe everything",
                                                            max_new_tokens=4096))
    tester.wait_for_status(lambda s: status_values(s)["serving"] == "ask", timeout=60)
    return future


def test_a_signal_during_a_question_exits_0_quickly(tiny_model_dir, ros_domain):
    """A long answer (hundreds of tokens on the tiny model) is in progress when SIGINT comes."""
    process = start(tiny_model_dir, ros_domain, max_new_tokens="4096")
    tester = Tester()
    try:
        future = ask_a_long_answer(tester, process)
        code, seconds, err = exit_after(process, signal.SIGINT)
    finally:
        tester.close()
    assert not (future.done() and future.result().success)  # it was cut short
    assert code == 0 and "terminate called" not in err, err[-3000:]
    assert seconds < 15.0


@pytest.mark.parametrize("transitions", [["shutdown"], ["deactivate", "cleanup"]])
def test_a_question_cut_by_lifecycle_transitions_then_sigint_exits_0(slow_model_dir, ros_domain,
                                                                     transitions):
    """A 4096-token answer in progress, then lifecycle transitions, then SIGINT: the question
    stops at its next token, so no thread is left inside torch at exit (it aborted with
    "terminate called without an active exception", rc -6). The 512-layer model decodes slowly
    enough that its answer is still being written when the transitions come (the 2-layer one
    reached its end of turn first on a busy machine)."""
    process = start(slow_model_dir, ros_domain, max_new_tokens="4096")
    tester = Tester()
    try:
        future = ask_a_long_answer(tester, process)
        for label in transitions:
            assert tester.transition(label), label
        reply = wait_future(future, 30)
        assert not reply.success and reply.message  # cut short, and told why
        code, seconds, err = exit_after(process, signal.SIGINT)
    finally:
        tester.close()
    assert code == 0 and "terminate called" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("sig,parent_ignores", [(signal.SIGINT, False), (signal.SIGINT, True),
                                                (signal.SIGTERM, False)])
@pytest.mark.parametrize("delay_s", [0.3, 1.5])
def test_a_signal_while_the_imports_load_exits_0_without_a_traceback(tiny_model_dir, ros_domain,
                                                                     delay_s, sig, parent_ignores):
    """Also when the node is started with SIGINT ignored, as a script's or CI's background job
    starts it: the signal that came during the imports was lost, and the node ran on. SIGTERM
    there killed the process (rc -15)."""
    process = start(tiny_model_dir, ros_domain, ignore_sigint=parent_ignores)
    time.sleep(delay_s)  # torch and transformers take seconds to import
    code, seconds, err = exit_after(process, sig)
    assert code == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_during_the_exit_after_shutdown_exit_0(tiny_model_dir, ros_domain, sig):
    """After the `shutdown` transition the process leaves by itself; signals sent all along
    that exit (every 20 ms from its "finalized: exiting" to the process's end: after rclpy
    removed its handlers, into the interpreter's finalization) change nothing. SIGINT there
    ended the process with rc -2, SIGTERM with rc -15."""
    process = start(tiny_model_dir, ros_domain)
    log = StderrLog(process)
    tester = Tester()
    try:
        tester.wait_ready(process)
        assert tester.transition("shutdown")
    finally:
        tester.close()
    log.wait_for("finalized: exiting", timeout=60)
    sent = 0
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        process.send_signal(sig)  # the process may end between poll and send: harmless
        sent += 1
        time.sleep(0.02)
    code, err = log.stop()
    assert sent > 0, "the process ended before a signal was sent"
    assert code == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


@pytest.mark.parametrize("overrides,reason", [
    ({"budget_tokens": "100", "window_tokens": "200"}, "budget_tokens (100) must be at least"),
    ({"memory_file": "/etc/deltas.safetensors"}, "outside memory_dir"),
    ({"memory_key_file": "/etc/hostname"}, "memory_key_file"),
    ({"policy": "oracle"}, "cannot start: policy: must be one of"),
    # As `ros2 run deltas_ros memory_node --ros-args -p ...` gives them, without the params
    # file (rcl drops a -p value whose type differs from the params file's, such as 1.5).
    ({"budget_tokens": "-5", "bare": True},
     "cannot start: budget_tokens: must be within [1, 1e+07]"),
    ({"fps": "nan", "bare": True}, "cannot start: fps: must be within [0.1, 30]"),
    ({"budget_tokens": "1.5", "bare": True}, "cannot start: budget_tokens: must be an integer"),
])
def test_start_up_refusals_give_the_reason_in_one_line(tiny_model_dir, ros_domain, overrides,
                                                       reason):
    overrides = dict(overrides)
    if overrides.pop("bare", False):
        command = [str(PREFIX / "lib" / "deltas_ros" / "memory_node"), "--ros-args",
                   "-p", f"model_path:={tiny_model_dir}"]
        for key, value in overrides.items():
            command += ["-p", f"{key}:={value}"]
        process = subprocess.Popen(command, env=ros_domain, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    else:
        process = start(tiny_model_dir, ros_domain, **overrides)
    process.wait(timeout=180)
    err = process.stderr.read()
    assert process.returncode == 1 and reason in err, err
    assert "Traceback" not in err and "AttributeError" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
