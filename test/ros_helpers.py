"""Helpers shared by the tests that talk to a node over DDS: the launch command, this process's
side of the graph (camera publisher, listeners, clients), frames and stamps.

Not a test module (pytest does not collect it); test files import from here, never from each
other. The `ros_domain` fixture is in conftest.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import rclpy
from deltas_ros.action import AskMemory as AskAction
from deltas_ros.msg import DriftScore
from deltas_ros.srv import AskMemory
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from engine_helpers import wait_until
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
from rclpy.action import ActionClient
from rclpy.action.client import ClientGoalHandle
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import CompressedImage, Image
from std_srvs.srv import Trigger

REPO = Path(__file__).resolve().parents[1]


def package_prefix() -> Path:
    """Where deltas_ros is installed: the sourced ROS install (`colcon test`) when the ament
    index knows it, else this interpreter's prefix (scripts/setup.sh installs into .venv)."""
    if os.environ.get("AMENT_PREFIX_PATH"):
        from ament_index_python.packages import PackageNotFoundError, get_package_prefix

        try:
            return Path(get_package_prefix("deltas_ros"))
        except PackageNotFoundError:
            pass
    return Path(sys.prefix)


PREFIX = package_prefix()
BASE_STAMP = 1_700_000_000.0
SMALL = {"pixel_budget": "4096", "budget_tokens": "120", "window_tokens": "40",
         "max_new_tokens": "4", "silence_warn_s": "2.0"}


def node_command(model_dir: Path, topic: str, **overrides: str) -> list[str]:
    """The command line launch/deltas.launch.py produces, plus test-size overrides."""
    args = [str(PREFIX / "lib" / "deltas_ros" / "memory_node"), "--ros-args",
            "-r", "__node:=deltas_memory",
            "--params-file", str(REPO / "config" / "deltas.yaml"),
            "-p", f"model_path:={model_dir}", "-p", f"image_topic:={topic}",
            "-p", "use_sim_time:=false"]
    for key, value in overrides.items():
        args += ["-p", f"{key}:={value}"]
    return args


class Tester:
    """This process's side of the graph: camera publisher, listeners, service clients."""

    __test__ = False  # a helper, not a test class

    def __init__(self, namespace: str = "/deltas_memory", topic: str = "/camera/image_raw",
                 compressed: bool = False, camera_qos: QoSProfile | int = 50) -> None:
        """camera_qos: the camera publisher's QoS (a depth: reliable, rclpy's default)."""
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = Node("tester", context=self.context)
        self.lock = threading.Lock()
        self.published = 0  # camera frames this tester published
        msg_type = CompressedImage if compressed else Image
        self.camera = self.node.create_publisher(msg_type, topic, camera_qos)
        self.clock = self.node.create_publisher(Clock, "/clock", 10)
        self.drift: list[DriftScore] = self.collecting(DriftScore, f"{namespace}/drift", 100)
        self.diagnostics: list[DiagnosticArray] = self.collecting(DiagnosticArray,
                                                                  "/diagnostics", 10)
        self.ask_client = self.node.create_client(AskMemory, f"{namespace}/ask_memory")
        self.reset_client = self.node.create_client(Trigger, f"{namespace}/reset_memory")
        self.params_client = self.node.create_client(SetParameters,
                                                     f"{namespace}/set_parameters")
        self.change_state_client = self.node.create_client(ChangeState,
                                                           f"{namespace}/change_state")
        self.get_state_client = self.node.create_client(GetState, f"{namespace}/get_state")
        # Made before the spin thread starts: rclpy registers an action client with the node
        # before it is fully built, and a spinning executor then fails on it (AttributeError
        # '_lock' in the spin thread, which ends it: a CI failure, no diagnostics arrived).
        self.action = ActionClient(self.node, AskAction, f"{namespace}/ask")
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        try:
            while not self.stopping.is_set() and self.context.ok():
                self.executor.spin_once(timeout_sec=0.05)
        except ExternalShutdownException:
            pass

    def collecting(self, msg_type: type, topic: str, qos: QoSProfile | int) -> list:
        """The list that every message on `topic` is appended to (under `lock`)."""
        received: list = []

        def keep(msg: Any) -> None:
            with self.lock:
                received.append(msg)

        self.node.create_subscription(msg_type, topic, keep, qos)
        return received

    def wait_ready(self, process: subprocess.Popen, timeout: float = 180.0) -> None:
        """Until the model is loaded (an empty question is refused as empty, not "not ready")
        and the camera is matched both ways: discovery is asymmetric, and frames sent before
        the node's subscription has matched our publisher are lost (a fresh node then started
        its stream late: the CI flakes of the restart and out-of-memory tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"node exited early: {process.stderr.read()}")
            if self.ask_client.service_is_ready() and self.camera.get_subscription_count():
                try:
                    if "not ready" not in self.ask(" ", timeout=10).error:
                        self.wait_for_status(lambda s: int(status_values(s).get(
                            "camera_publishers", 0)) > 0, deadline - time.monotonic())
                        return
                except AssertionError:  # no answer yet: a starting node can be that busy
                    pass
            time.sleep(0.1)
        raise AssertionError("node did not come up")

    def call(self, client, request, timeout: float = 60.0):
        # A request sent before the client has discovered the service is lost.
        assert client.wait_for_service(timeout_sec=30), f"no {client.srv_name} service"
        future = client.call_async(request)
        deadline = time.monotonic() + timeout
        while not future.done():
            assert time.monotonic() < deadline, "service call timed out"
            time.sleep(0.02)
        return future.result()

    def ask(self, question: str, max_new_tokens: int = 0,
            timeout: float = 60.0) -> AskMemory.Response:
        return self.call(self.ask_client,
                         AskMemory.Request(question=question, max_new_tokens=max_new_tokens),
                         timeout)

    def transition(self, label: str, timeout: float = 120.0) -> bool:
        """Drive the node's lifecycle as a manager does (lifecycle_msgs ChangeState by label:
        configure, activate, deactivate, cleanup, shutdown); whether it succeeded."""
        request = ChangeState.Request(transition=Transition(label=label))
        return self.call(self.change_state_client, request, timeout).success

    def lifecycle_state(self) -> str:
        """The node's lifecycle state label (lifecycle_msgs GetState)."""
        return self.call(self.get_state_client, GetState.Request()).current_state.label

    def reset(self) -> None:
        """Reset the memory once the node has taken every frame published so far: a frame still
        on its way (reliable delivery lags on a loaded machine) would otherwise start the next
        stream and count as a jump back (the CI flakes of the 1x/2x and save/load tests)."""
        self.wait_for_frames()
        assert self.call(self.reset_client, Trigger.Request()).success
        with self.lock:
            self.drift.clear()

    def wait_for_frames(self, timeout: float = 120.0) -> None:
        """Until the node's diagnostics count every frame this tester published as received."""
        self.wait_for(lambda: int(self.newest_values().get("frames_received", 0))
                      >= self.published, timeout)

    def newest_values(self) -> dict[str, str]:
        """The newest diagnostics report's values ({} before the first); the caller holds
        self.lock."""
        return status_values(self.diagnostics[-1].status[0]) if self.diagnostics else {}

    def stream(self, seconds: float, speed: float = 1.0, fps: float = 30.0,
               start: float = BASE_STAMP, make=None, on_frame=None) -> None:
        """Publish `seconds` of frames with stamps start + i/fps, paced at `speed` x real time."""
        make = make or raw_frame
        wall0 = time.monotonic()
        for i in range(int(seconds * fps)):
            stamp = start + i / fps
            self.camera.publish(make(i, stamp))
            self.published += 1
            self.clock.publish(Clock(clock=stamp_msg(stamp)))
            if on_frame:
                on_frame(i)
            delay = wall0 + (i + 1) / fps / speed - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def wait_for(self, predicate, timeout: float = 120.0) -> None:
        """Poll `predicate` (under the lock) until it holds; a bound, not a pace: it returns as
        soon as the predicate holds, so it is generous for a loaded CI machine."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return
            time.sleep(0.05)
        with self.lock:
            newest, drift = self.newest_values(), len(self.drift)
        raise AssertionError(f"condition not reached in {timeout:g} s; {drift} drift messages, "
                             f"{self.published} frames published, the node's newest "
                             f"diagnostics: {newest}")

    def last_status(self) -> tuple[int, dict[str, str]]:
        with self.lock:
            status = self.diagnostics[-1].status[0]
        return status.level, status_values(status)

    def wait_for_status(self, predicate, timeout: float = 15.0) -> DiagnosticStatus:
        """The newest diagnostics status once `predicate` holds for it: reports come once a
        second, later on a busy machine, so poll rather than sleep a fixed time."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                status = self.diagnostics[-1].status[0] if self.diagnostics else None
            if status is not None and predicate(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"no such diagnostics status in time; newest: {status}")
            time.sleep(0.05)

    def close(self) -> None:
        """The spin thread ends before the context does: shut down under it, spin_once raises
        RCLError between two waits (a warning in a loaded suite run)."""
        self.stopping.set()
        self.thread.join(2)
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def wait_future(future, timeout: float):
    """The future's result; the Tester's executor thread completes it, so poll (bounded)."""
    assert wait_until(future.done, timeout), "timed out"
    return future.result()


def send_goal(client: ActionClient, goal, timeout: float = 60.0,
              feedback: list | None = None) -> ClientGoalHandle:
    """The goal's handle once the server has accepted or rejected it (`handle.accepted`);
    feedback messages are appended to `feedback` when given.

    Jazzy's rclpy registers a goal request only after sending it, so the Tester's spin thread
    can take the response first and drop it ("Ignoring unexpected goal response"): a goal
    unanswered for half the timeout is sent once more (a question leaves the memory as it was).
    The server runs the first goal too; only the answered goal's feedback is collected."""
    assert client.wait_for_server(timeout_sec=30), "no ask action server"
    feedback_of = _AnsweredFeedback(feedback)
    for attempt in range(2):
        future = client.send_goal_async(
            goal, feedback_callback=None if feedback is None else feedback_of.callback(attempt))
        if wait_until(future.done, timeout / 2):
            feedback_of.answered(attempt)
            return future.result()
    raise AssertionError("timed out: no goal response")


class _AnsweredFeedback:
    """Routes the feedback of `send_goal`'s attempts: the answered attempt's goes to `out`,
    including what arrived before its goal response (held until then); the others' is dropped."""

    def __init__(self, out: list | None) -> None:
        self.out, self.lock = out, threading.Lock()
        self.chosen: int | None = None
        self.early: dict[int, list] = {}

    def callback(self, attempt: int):
        def on_feedback(msg) -> None:
            with self.lock:
                if self.chosen is None:
                    self.early.setdefault(attempt, []).append(msg.feedback)
                elif self.chosen == attempt:
                    self.out.append(msg.feedback)
        return on_feedback

    def answered(self, attempt: int) -> None:
        with self.lock:
            self.chosen = attempt
            if self.out is not None:
                self.out.extend(self.early.pop(attempt, []))
            self.early.clear()


def set_parameter(tester: Tester, name: str, value: int):
    """Set an integer parameter of the node through its set_parameters service; the result."""
    request = SetParameters.Request(parameters=[Parameter(name=name, value=ParameterValue(
        type=ParameterType.PARAMETER_INTEGER, integer_value=value))])
    return tester.call(tester.params_client, request).results[0]


def status_values(status: DiagnosticStatus) -> dict[str, str]:
    return {kv.key: kv.value for kv in status.values}


def stamp_msg(stamp: float):
    from deltas_ros.ros.messages import to_time_msg

    return to_time_msg(stamp)


def scene(i: int) -> np.ndarray:
    """A still scene that changes every 2 s (a new random texture), 120x160 RGB."""
    rng = np.random.default_rng(i // 60)
    return rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)


def raw_frame(i: int, stamp: float, encoding: str = "rgb8") -> Image:
    pixels = scene(i)
    msg = Image(height=120, width=160, encoding=encoding, step=160 * 3,
                data=pixels.tobytes())
    msg.header.stamp = stamp_msg(stamp)
    msg.header.frame_id = "camera"
    return msg


def start(model_dir: Path, env: dict[str, str], topic: str = "/camera/image_raw",
          ignore_sigint: bool = False, **overrides: str) -> subprocess.Popen:
    """The node process; ignore_sigint: started as a script's or CI's background job is, with
    SIGINT ignored (inherited across exec)."""
    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(node_command(model_dir, topic, **(SMALL | overrides)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignore if ignore_sigint else None)


def stop(process: subprocess.Popen, sig: int = signal.SIGINT) -> tuple[int, str]:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return process.returncode, err


class StderrLog:
    """A node process's stderr, read on a thread from start to exit: wait for a line, count
    lines, without the pipe filling up (a blocked writer would stall the node)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.lines, self.lock = process, [], threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def count(self, text: str) -> int:
        with self.lock:
            return sum(text in line for line in self.lines)

    def text(self) -> str:
        with self.lock:
            return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120.0) -> str:
        """The first line with `text`, waiting at most `timeout` s for it."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                if found := next((line for line in self.lines if text in line), None):
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None and not self.thread.is_alive():
                    raise AssertionError(f"no {text!r} in: {''.join(self.lines)[-3000:]}")
                self.changed.wait(min(left, 0.5))

    def stop(self, sig: int = signal.SIGINT) -> tuple[int, str]:
        """Signal the process; (its return code, all of its stderr)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.thread.join(10)
        return self.process.returncode, self.text()


def indices(msgs: list[DriftScore]) -> list[int]:
    return [m.chunk_index for m in msgs]


def make_slow_loading_model(out_dir: Path, layers: int = 512) -> Path:
    """The tiny model, but `layers` deep (bf16, ~47 MB at 512): from_pretrained takes seconds,
    as real weights take minutes, where the tiny model loads too quickly for a test to signal
    the node during the load."""
    import torch

    from deltas_ros.core.model_maker import make_model, tiny_config

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    config = tiny_config(text={"num_hidden_layers": layers, "layer_types": layer_types})
    return make_model(out_dir, config, dtype=torch.bfloat16)
