"""A camera in its own process: synthetic frames published over DDS at a fixed rate.

Why: the ingest and end-to-end benchmarks must not pay for making the frames they measure, so the
frames come from another process, as they would from a camera driver.

How: one second of a synthetic stream (synth_stream) is encoded once, as sensor_msgs/Image rgb8 or
sensor_msgs/CompressedImage JPEG, and published in a loop with header stamps start + i / fps,
paced by the wall clock, after the wanted subscribers have matched (reliable QoS, a history of the
whole stream). Before exiting it waits until every frame is acknowledged, then prints one JSON line
(frames published, its own CPU seconds and wall seconds while publishing); with --log it also
writes each frame's stamp (ns) and publish wall time (time.time(), taken just before publish) for
latency measurements.

    python -m bench.camera_pub --topic /camera/image_raw --encoding rgb8 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import cv2
import rclpy
from builtin_interfaces.msg import Time
from rclpy.duration import Duration
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image

from deltas_ros.training.synth import NS_PER_S, stamp_ns, synth_stream

# After matching, the subscriber's side of discovery may still be in flight: frames it misses
# are resent once it matches, but late, which would skew latencies of the first ones.
SETTLE_S = 0.5
ACK_TIMEOUT_S = 30.0  # before exiting: reliable frames still unacknowledged would be lost
JPEG_QUALITY = 90


def frame_bank(encoding: str, width: int, height: int, fps: float,
               seed: int) -> list[Image | CompressedImage]:
    """One second of distinct frames as ready-to-publish messages."""
    frames, _ = synth_stream(1.0, fps, width, height, seed)
    bank: list[Image | CompressedImage] = []
    for _, rgb in frames:
        if encoding == "rgb8":
            bank.append(Image(height=height, width=width, encoding="rgb8", step=3 * width,
                              data=rgb.tobytes()))
        else:
            ok, jpeg = cv2.imencode(".jpg", rgb[..., ::-1],
                                    [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
            if not ok:
                raise RuntimeError("OpenCV failed to encode a JPEG frame")
            bank.append(CompressedImage(format="jpeg", data=jpeg.tobytes()))
        bank[-1].header.frame_id = "camera"
    return bank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topic", default="/camera/image_raw")
    parser.add_argument("--encoding", default="rgb8", choices=["rgb8", "jpeg"])
    parser.add_argument("--fps", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--start-stamp", type=float, default=1_700_000_000.0)
    parser.add_argument("--subscribers", type=int, default=1, help="wait for this many")
    parser.add_argument("--wait-s", type=float, default=60.0, help="give up after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, help="JSON file of [stamp_ns, publish wall time]")
    args = parser.parse_args(argv)

    bank = frame_bank(args.encoding, args.width, args.height, args.fps, args.seed)
    count = round(args.seconds * args.fps)
    rclpy.init()
    node = rclpy.create_node("bench_camera")
    # A history of the whole stream: reliable QoS then resends every frame a subscriber missed
    # (one that matched late, or stalled on a busy machine) instead of dropping the oldest.
    # Acknowledged frames leave it (volatile), so it holds only those in flight.
    qos = QoSProfile(depth=max(count, 1), reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.VOLATILE)
    publisher = node.create_publisher(type(bank[0]), args.topic, qos)
    deadline = time.monotonic() + args.wait_s
    while publisher.get_subscription_count() < args.subscribers:
        if time.monotonic() > deadline:
            print(f"no subscriber on {args.topic} within {args.wait_s} s", file=sys.stderr)
            return 2
        time.sleep(0.05)
    time.sleep(SETTLE_S)

    log: list[tuple[int, float]] = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    for i in range(count):
        ns = stamp_ns(args.start_stamp, i, args.fps)
        msg = bank[i % len(bank)]
        msg.header.stamp = Time(sec=ns // NS_PER_S, nanosec=ns % NS_PER_S)
        log.append((ns, time.time()))
        publisher.publish(msg)
        delay = wall0 + (i + 1) / args.fps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    summary = {"published": count, "cpu_s": time.process_time() - cpu0,
               "wall_s": time.monotonic() - wall0,
               "message_bytes": len(bank[0].data)}
    publisher.wait_for_all_acked(Duration(seconds=ACK_TIMEOUT_S))
    if args.log:
        args.log.write_text(json.dumps(log))
    print(json.dumps(summary), flush=True)
    node.destroy_node()
    rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
