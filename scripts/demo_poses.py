"""The demo's robot odometry: a made-up lap of a room, published in step with the camera.

    .venv/bin/python scripts/demo_poses.py [--camera /camera/image_raw] [--odom /odom]

The demo's bag has frames only, so scripts/demo.sh --dashboard starts this beside the replay and
the memory node gets `pose_topic:=/odom`: every camera frame gets a nav_msgs/Odometry in the
`odom` frame with the frame's own stamp, the robot driving counter-clockwise around an ellipse
(5 x 3 m, one lap in 24 s of stream time). It subscribes to the camera only once another node
(the memory node) has, so the replay, which waits for a subscriber, never starts on it alone.
Runs until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import math
import time

import rclpy
from nav_msgs.msg import Odometry
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image

LAP_S = 24.0
RADII = (2.5, 1.5)


def odometry(stamp, t: float) -> Odometry:
    """The robot at `t` seconds into the stream, stamped `stamp`."""
    angle = 2 * math.pi * t / LAP_S
    heading = math.atan2(RADII[1] * math.cos(angle), -RADII[0] * math.sin(angle))
    msg = Odometry()
    msg.header.stamp, msg.header.frame_id, msg.child_frame_id = stamp, "odom", "base_link"
    msg.pose.pose.position.x = RADII[0] * math.cos(angle)
    msg.pose.pose.position.y = RADII[1] * math.sin(angle)
    msg.pose.pose.orientation.z = math.sin(heading / 2)
    msg.pose.pose.orientation.w = math.cos(heading / 2)
    return msg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--camera", default="/camera/image_raw")
    parser.add_argument("--odom", default="/odom")
    args = parser.parse_args()
    rclpy.init()  # its signal handlers: Ctrl-C and SIGTERM shut the context down
    node = Node("demo_poses")
    publisher = node.create_publisher(Odometry, args.odom, 50)
    first: list[float] = []  # the stream's first stamp (seconds); reset when time runs back

    def on_frame(msg: Image) -> None:
        now = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        if not first or now < first[0]:
            first[:] = [now]
        publisher.publish(odometry(msg.header.stamp, now - first[0]))

    try:
        while rclpy.ok() and node.count_subscribers(args.camera) < 1:
            time.sleep(0.02)
        if rclpy.ok():
            node.create_subscription(Image, args.camera, on_frame, qos_profile_sensor_data)
            rclpy.spin(node)
    except ExternalShutdownException:
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
