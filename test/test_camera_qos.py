"""The camera subscription's QoS: rclpy's override parameters, the reliable_qos alias, and
following the publisher when neither is given (one process, no model)."""

import pytest
import rclpy
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image

from deltas_ros.ros_adapters import CameraSubscription, camera_topic

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
