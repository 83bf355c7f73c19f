"""The managed node, driven from this process through the standard lifecycle_msgs
services as a lifecycle manager drives it: every transition; questions and camera only while
active; the memory and its stream kept across deactivate/activate; the model and the memory
freed by cleanup (RSS of the node's process); the autosave at shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest
import rclpy
from deltas_ros.action import AskMemory as AskAction
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState
from rclpy.context import Context
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from ros_helpers import BASE_STAMP, Tester, indices, send_goal, start, status_values, stop

from deltas_ros.core.model_maker import make_model, tiny_config
from deltas_ros.ros.lifecycle_state import RefusedTransitions, lifecycle_state

BIG_VOCAB = 300_000  # embedding + lm_head: 38 M parameters (154 MB) and almost no compute
MODEL_BYTES = 2 * BIG_VOCAB * tiny_config().text_config.hidden_size * 4


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a vocabulary large enough that freeing it shows in the RSS."""
    config = tiny_config()
    config.text_config.vocab_size = BIG_VOCAB
    return make_model(tmp_path_factory.mktemp("models") / "big", config)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_the_lifecycle_state_is_rclpys_own(ros_env):
    """The state diagnostics report is read from rclpy's state machine (a private name rclpy
    may move: this fails naming it)."""
    context = Context()
    rclpy.init(context=context)
    try:
        node = LifecycleNode("lifecycle_probe", context=context)
        assert lifecycle_state(node) == "unconfigured"
        node.trigger_configure()
        assert lifecycle_state(node) == "inactive"
        node.trigger_activate()
        assert lifecycle_state(node) == "active"
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


def test_a_transition_the_state_does_not_allow_fails_with_error(ros_env):
    """Kilted's rclpy returns ERROR for it, Jazzy's raised RCLError: RefusedTransitions makes
    both return ERROR, through the private name it overrides (this fails naming it)."""
    from rclpy.lifecycle.node import LifecycleNodeMixin

    assert callable(LifecycleNodeMixin._LifecycleNodeMixin__change_state)

    class Probe(RefusedTransitions, LifecycleNode):
        pass

    context = Context()
    rclpy.init(context=context)
    try:
        node = Probe("refusal_probe", context=context)
        assert node.trigger_activate() == TransitionCallbackReturn.ERROR
        assert lifecycle_state(node) == "unconfigured"
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


def test_every_transition_over_dds(big_model_dir, ros_env, tmp_path):
    process = start(big_model_dir, ros_env, autostart="false", reliable_qos="true",
                    memory_dir=str(tmp_path), autosave_chunks="1000")
    tester = Tester()
    try:
        # Up and spinning (its diagnostics come from the executor) before the first call.
        tester.wait_for_status(lambda s: status_values(s)["lifecycle"] == "unconfigured", 120)
        assert tester.lifecycle_state() == "unconfigured"
        assert "not configured" in tester.ask("what do you see?").error
        assert tester.camera.get_subscription_count() == 0

        assert tester.transition("configure") and tester.lifecycle_state() == "inactive"
        assert "not active" in tester.ask("what do you see?").error
        assert tester.camera.get_subscription_count() == 0  # no intake while inactive

        assert tester.transition("activate") and tester.lifecycle_state() == "active"
        tester.wait_for(lambda: tester.camera.get_subscription_count() == 1)
        tester.stream(3.0, speed=2.0)
        tester.wait_for(lambda: len(tester.drift) == 3, timeout=60)
        assert tester.ask("what do you see?").success

        # Deactivate: no intake (frames sent now reach nobody), questions refused, memory kept.
        assert tester.transition("deactivate") and tester.lifecycle_state() == "inactive"
        tester.wait_for(lambda: tester.camera.get_subscription_count() == 0)
        assert "not active" in tester.ask("what do you see?").error
        assert tester.wait_for_status(lambda s: "inactive" in s.message)
        tester.stream(1.0, speed=2.0, start=BASE_STAMP + 3.0)

        # Activate again: the same stream goes on (indices and stream times after the gap).
        assert tester.transition("activate")
        tester.wait_for(lambda: tester.camera.get_subscription_count() == 1)
        tester.stream(2.0, speed=2.0, start=BASE_STAMP + 4.0)
        tester.wait_for(lambda: len(tester.drift) == 5, timeout=60)
        assert indices(tester.drift) == [0, 1, 2, 3, 4]
        assert all(m.stream_time >= 4.0 for m in tester.drift[3:])  # after the gap
        answer = tester.ask("what do you see?")
        assert answer.success and answer.memory_span_end >= 5.0

        # Cleanup frees the model and the memory. (The weights are mapped from their file and
        # come into the RSS as they are used: the answers above used the whole lm_head.)
        assert tester.transition("deactivate")
        rss_in_use = rss_bytes(process.pid)
        assert tester.transition("cleanup") and tester.lifecycle_state() == "unconfigured"
        freed = rss_in_use - rss_bytes(process.pid)
        assert freed > 0.4 * MODEL_BYTES, (rss_in_use, freed)
        assert "not configured" in tester.ask("what do you see?").error

        # Configure again: a fresh memory; shutdown from active autosaves it.
        assert tester.transition("configure") and tester.transition("activate")
        tester.wait_for(lambda: tester.camera.get_subscription_count() == 1)
        tester.stream(1.0, speed=2.0, start=BASE_STAMP + 100.0)
        tester.wait_for(lambda: len(tester.drift) == 6, timeout=60)
        assert tester.drift[-1].chunk_index == 0
        assert tester.transition("shutdown")
        assert (tmp_path / "memory.safetensors").is_file()
        # Finalized is final: the process leaves by itself (a launch file's respawn starts a
        # fresh node), with code 0.
        process.wait(timeout=60)
    finally:
        tester.close()
        code, err = stop(process)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert "cleanup: the model and the memory are freed" in err


def test_autostart_false_and_a_refused_configure_stay_up(tmp_path, ros_env):
    """Without autostart a bad model path fails the configure transition, with its reason, and
    the node stays unconfigured for a manager to try again (autostart refuses to start); ask
    goals are rejected while it is unconfigured."""
    process = start(tmp_path / "nothing-here", ros_env, autostart="false")
    tester = Tester()
    goal = AskAction.Goal(question="what do you see?", max_new_tokens=2)
    try:
        tester.wait_for_status(lambda s: status_values(s)["lifecycle"] == "unconfigured", 120)
        assert tester.lifecycle_state() == "unconfigured"
        assert not send_goal(tester.action, goal).accepted
        assert not tester.transition("configure")
        assert tester.lifecycle_state() == "unconfigured" and process.poll() is None
        assert not send_goal(tester.action, goal).accepted
        # A manager that names transitions by id (nav2's does) and asks for one the state does
        # not allow is refused, and the node stays up (lifecycle_state.RefusedTransitions).
        activate = ChangeState.Request(transition=Transition(id=Transition.TRANSITION_ACTIVATE))
        assert not tester.call(tester.change_state_client, activate).success
        assert tester.lifecycle_state() == "unconfigured" and process.poll() is None
    finally:
        tester.close()
        code, err = stop(process)
    assert code == 0 and "no model at" in err, err[-3000:]
