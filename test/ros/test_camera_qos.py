"""The camera subscription's QoS: rclpy's override parameters, the reliable_qos alias, and
following the publisher when neither is given (one process, no model); then over DDS with the
node process, what it says when a camera is matched but silent, or cannot be matched."""

import os
import threading

import pytest
import rclpy
from engine_helpers import wait_until
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from ros_helpers import StderrLog, Tester, start
from sensor_msgs.msg import Image

from deltas_ros.ros.camera import CameraSubscription, camera_topic

PREFIX = "qos_overrides./cam.subscription."


@pytest.fixture
def context(ros_env):
    context = rclpy.Context()
    rclpy.init(context=context, args=["--ros-args", "-r", "image:=/remapped/cam"])
    yield context
    rclpy.try_shutdown(context=context)


def node_with(context, **overrides) -> Node:
    return Node("camera_qos", context=context, parameter_overrides=[
        Parameter(PREFIX + name, value=value) for name, value in overrides.items()])


def subscribe(node: Node, forced: bool = False) -> CameraSubscription:
    return CameraSubscription(node, Image, "/cam", lambda msg: None, forced, 60)


def test_overrides_set_reliability_and_depth(context):
    node = node_with(context, reliability="best_effort", depth=7)
    camera = subscribe(node)
    qos = camera.subscription.qos_profile
    assert (qos.reliability, qos.depth) == (ReliabilityPolicy.BEST_EFFORT, 7)
    node.create_publisher(Image, "/cam", QoSProfile(depth=1))  # reliable: not followed
    camera.follow(silence_warn_s=1e6, last_frame=0.0)
    assert camera.subscription.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT
    node.destroy_node()


def test_reliable_qos_is_an_alias_and_no_override_follows_the_publisher(context):
    node = node_with(context)
    assert subscribe(node, forced=True).subscription.qos_profile.reliability == \
        ReliabilityPolicy.RELIABLE
    node.destroy_node()
    node = Node("camera_qos_follow", context=context)
    camera = subscribe(node)
    assert camera.subscription.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT
    node.create_publisher(Image, "/cam", QoSProfile(depth=1))
    camera.follow(silence_warn_s=1e6, last_frame=0.0)
    assert camera.subscription.qos_profile.reliability == ReliabilityPolicy.RELIABLE
    node.destroy_node()


def test_a_bad_override_is_refused(context):
    node = node_with(context, reliability="sometimes")
    with pytest.raises(ValueError, match="reliable or best_effort"):
        subscribe(node)
    node.destroy_node()


def test_a_bad_history_or_depth_override_is_refused(context):
    with pytest.raises(ValueError, match="keep_last or keep_all"):
        subscribe(node_with(context, history="keep_some"))
    with pytest.raises(ValueError, match="integer >= 1"):
        subscribe(node_with(context, depth=0))


def test_frames_arrive_on_the_camera_s_own_thread_and_stop_at_close(context):
    """The memory node's executor never runs the camera: here nothing spins the node at all,
    and frames still reach the callback, on the camera's thread; after close() none does, and
    the camera's node has left the graph."""
    node = Node("memory", namespace="/robot", context=context)
    threads: list[str] = []
    camera = CameraSubscription(node, Image, "/cam",
                                lambda raw: threads.append(threading.current_thread().name),
                                True, 60)
    assert camera.camera_node.get_fully_qualified_name() == "/robot/memory_camera"
    sender = Node("sender", context=context)
    publisher = sender.create_publisher(Image, "/cam", QoSProfile(depth=10))
    assert wait_until(lambda: publisher.get_subscription_count() == 1)
    assert wait_until(lambda: publisher.publish(Image(height=1, width=1, step=3,
                                                      encoding="rgb8", data=b"abc")) or threads)
    assert set(threads) == {"camera"}
    camera.close()
    assert not camera.thread.is_alive()
    assert wait_until(lambda: publisher.get_subscription_count() == 0)
    assert "memory_camera" not in node.get_node_names()
    sender.destroy_node()
    node.destroy_node()


def test_the_camera_thread_ends_quietly_when_a_signal_shuts_the_context_down(context):
    """SIGINT shuts the context down while the camera thread spins: between two waits,
    spin_once raises RCLError (no wait set on a dead context), not ExternalShutdownException.
    A suite run under load once caught that traceback in the node's stderr at exit."""
    camera = subscribe(Node("memory", context=context))
    camera.stopping.set()
    camera.thread.join()
    camera.stopping.clear()
    context.shutdown()
    camera.spin()  # the thread's loop, after the signal: returns without raising


def test_the_relative_name_image_is_remappable(context):
    node = Node("camera_topic", context=context)
    assert camera_topic(node, False, "/camera/image_raw") == "/remapped/cam"
    assert camera_topic(node, True, "/camera/image_raw") == "/remapped/cam/compressed"
    node.destroy_node()
    plain = rclpy.Context()
    rclpy.init(context=plain)
    node = Node("camera_topic", context=plain)
    assert camera_topic(node, False, "/camera/image_raw") == "/camera/image_raw"
    node.destroy_node()
    rclpy.try_shutdown(context=plain)


# Over DDS: the node process (tiny model) and a camera in this process.
SILENT = "a camera publisher is matched on /camera/image_raw but no frame arrived"
INCOMPATIBLE = "camera QoS incompatible with ours"


@pytest.fixture
def node_env(ros_env, tmp_path, monkeypatch) -> dict[str, str]:
    """ros_env with memory_dir (under ROS_HOME) in tmp_path."""
    monkeypatch.setenv("ROS_HOME", str(tmp_path / "ros_home"))
    return dict(os.environ)


@pytest.mark.parametrize("camera_qos,ours,cause", [
    (50, "reliable", "the camera publishes nothing"),
    (qos_profile_sensor_data, "best effort", "FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA"),
])
def test_a_matched_camera_that_sends_nothing_is_explained_once(tiny_model_dir, node_env,
                                                               camera_qos, ours, cause):
    """A camera publisher matched (the node follows its reliability) that delivers no frame for
    silence_warn_s (2 s here): one warning, with the cause likely for our reliability and the
    fix, not one a diagnostics tick."""
    log = StderrLog(start(tiny_model_dir, node_env))
    tester = Tester(camera_qos=camera_qos)
    try:
        tester.wait_ready(log.process)
        line = log.wait_for(SILENT, timeout=60)
        reports = len(tester.diagnostics)
        # Four more diagnostics ticks, each of which calls follow() with the camera still silent.
        tester.wait_for(lambda: len(tester.diagnostics) >= reports + 4, timeout=30)
    finally:
        tester.close()
        code, err = log.stop()
    assert code == 0, err[-3000:]
    assert f"(Image, {ours} QoS)" in err  # matched: it followed the camera
    assert cause in line, line
    assert err.count(SILENT) == 1, err[-3000:]
    assert INCOMPATIBLE not in err


@pytest.mark.parametrize("override", [
    {"reliable_qos": "true"},
    {"qos_overrides./camera/image_raw.subscription.reliability": "reliable"},
])
def test_a_best_effort_camera_and_a_reliable_node_are_reported_incompatible(
        tiny_model_dir, node_env, override):
    """Forced reliable (the alias or rclpy's override parameter) against a best-effort camera:
    DDS cannot match them, no frame can arrive, and the node says why (a matched-but-silent
    warning would be wrong: nothing is matched)."""
    log = StderrLog(start(tiny_model_dir, node_env, **override))
    tester = None
    try:
        log.wait_for("listening to /camera/image_raw (Image, reliable QoS)")
        tester = Tester(camera_qos=qos_profile_sensor_data)  # best effort, as many cameras
        line = log.wait_for(INCOMPATIBLE, timeout=60)
        reports = len(tester.diagnostics)  # a few ticks: a silence warning would show by now
        tester.wait_for(lambda: len(tester.diagnostics) >= reports + 4, timeout=30)
        assert tester.camera.get_subscription_count() == 0
    finally:
        if tester is not None:
            tester.close()
        code, err = log.stop()
    assert code == 0, err[-3000:]
    assert "(reliable) in reliability" in line and "leave reliable_qos false" in line, line
    assert SILENT not in err


def test_the_camera_thread_goes_on_when_its_subscription_is_replaced_under_its_wait(context):
    """`follow` re-subscribes from the memory node's thread; Jazzy's rclpy then raised
    InvalidHandle in the camera thread while it built its wait set (a CI run), which ended it.
    The next wait is built without the old subscription: the thread goes on."""
    from rclpy.impl.implementation_singleton import rclpy_implementation

    camera = subscribe(Node("memory", context=context))
    camera.stopping.set()
    camera.thread.join()
    camera.stopping.clear()
    waits = []

    def spin_once(timeout_sec: float) -> None:
        waits.append(timeout_sec)
        if len(waits) == 1:
            raise rclpy_implementation.InvalidHandle("destruction was requested")
        camera.stopping.set()

    camera.executor.spin_once = spin_once
    camera.spin()  # returns when stopped, not at the InvalidHandle
    assert len(waits) == 2
