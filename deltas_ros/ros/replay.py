"""Publishing a bag's camera topics live with rclpy, where `ros2 bag play` is not available.

Each message's stored CDR bytes are published unchanged, on the recorded time line scaled by
`rate`, so a subscriber receives exactly what was recorded. Only image topics are replayed. The
caller reads the bag (`deltas-ros replay` through tools/bag.py, so MCAP and sqlite3 bags both
work) and hands over its images; this side only publishes them.
"""

from __future__ import annotations

import importlib
import itertools
import signal
import time
from collections.abc import Iterator
from typing import Any, Protocol

import rclpy
from rclpy.context import Context
from rclpy.duration import Duration
from rclpy.node import Node
from rclpy.publisher import Publisher
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rosgraph_msgs.msg import Clock

NS_PER_S = 1_000_000_000
ACK_TIMEOUT_S = 2.0
# Longest sleep between two looks at a stop request: how soon Ctrl-C acts.
SLEEP_SLICE_S = 0.05


class ImageSource(Protocol):
    """What replay publishes (tools/bag.py's BagImages): topic -> message type, and a fresh
    pass over their messages in log-time order, each with `topic`, `log_time_ns` (the bag time
    replay follows) and `rawdata` (the CDR bytes as stored)."""

    topics: dict[str, str]

    def images(self) -> Iterator[Any]: ...


def message_class(msgtype: str) -> type:
    """The rclpy message class for a bag type name such as "sensor_msgs/msg/Image"."""
    package, _, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


def _wait_for_subscribers(node: Node, publishers: dict[str, Publisher], timeout_s: float) -> None:
    """Frames published before a subscriber has matched are lost; give discovery some time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(pub.get_subscription_count() >= 1 for pub in publishers.values()):
            return
        STOP.check()
        time.sleep(0.02)  # short: Ctrl-C acts between two sleeps
    waiting = [topic for topic, pub in publishers.items() if pub.get_subscription_count() < 1]
    if waiting:
        node.get_logger().warning(
            f"no subscriber after {timeout_s:g} s on {waiting}; publishing anyway"
        )


def replay_bag(
    source: ImageSource,
    rate: float = 1.0,
    loop: bool = False,
    publish_clock: bool = False,
    wait_for_subscribers_s: float = 10.0,
    node: Node | None = None,
    max_loops: int | None = None,
    reliable: bool = True,
) -> dict:
    """Publish the source's image topics on the recorded time line; returns what was done.

    Message i is due at wall0 + (t_i - t_first) / rate, t being the bag log time. With `loop`
    the bag repeats (at most `max_loops` passes) and its stamps jump back at each pass, as a
    consumer of a looping replay must handle. `publish_clock` also publishes the bag time on
    /clock before each message, for nodes running with use_sim_time. Without `node`, a private
    rclpy context and node are created and torn down. Ctrl-C stops it cleanly.

    Returns {"published": {topic: count}, "late_ms_max": float, "loops": completed passes,
    "wall_s": float, "interrupted": bool}.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, not {rate}")
    if max_loops is not None and max_loops < 1:
        raise ValueError(f"max_loops must be >= 1, not {max_loops}")
    selected = source.topics
    qos = (
        QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        if reliable
        else qos_profile_sensor_data
    )
    stats = {
        "published": dict.fromkeys(selected, 0),
        "late_ms_max": 0.0,
        "loops": 0,
        "wall_s": 0.0,
        "interrupted": False,
    }
    own_node = node is None
    context, publishers, clock = None, {}, None
    start = time.monotonic()
    try:  # set-up included: Ctrl-C at any moment tears down what exists
        if own_node:
            context = Context()
            rclpy.init(context=context)
            node = Node("deltas_replay", context=context)
        for topic, msgtype in selected.items():
            publishers[topic] = node.create_publisher(message_class(msgtype), topic, qos)
        if publish_clock:
            clock = node.create_publisher(Clock, "/clock", 10)
        # A use_sim_time consumer needs the clock from the first frame on, so /clock waits too.
        waited = {**publishers, "/clock": clock} if clock is not None else publishers
        _wait_for_subscribers(node, waited, wait_for_subscribers_s)
        start, wall0 = time.monotonic(), None
        while True:
            STOP.check()
            wall0 = play_once(source, rate, publishers, clock, wall0, stats)
            stats["loops"] += 1
            if not loop or (max_loops is not None and stats["loops"] >= max_loops):
                break
    except KeyboardInterrupt:
        stats["interrupted"] = True
    finally:
        stats["wall_s"] = round(time.monotonic() - start, 3)
        for publisher in [*publishers.values(), clock]:
            if publisher is None:
                continue
            if not stats["interrupted"]:
                # A reliable writer destroyed right after its last write can lose that message
                # (and the acknowledgement can take until the next heartbeat: up to the timeout).
                publisher.wait_for_all_acked(Duration(seconds=ACK_TIMEOUT_S))
            node.destroy_publisher(publisher)
        if own_node and node is not None:
            node.destroy_node()
        if context is not None:
            rclpy.try_shutdown(context=context)
    return stats


def play_once(
    source: ImageSource,
    rate: float,
    publishers: dict[str, Publisher],
    clock: Publisher | None,
    wall0: float | None,
    stats: dict,
) -> float:
    """One pass over the source, its first message due at `wall0` (None: now, once the bag is
    open); returns when the next pass is due: one mean frame interval after its last message."""
    images = source.images()
    first = next(images, None)  # opening the bag takes time: do it before the clock starts
    if first is None:
        return time.monotonic()
    if wall0 is None:
        wall0 = time.monotonic()
    first_ns = first.log_time_ns
    last_ns, count = first_ns, 0
    for image in itertools.chain([first], images):
        last_ns, count = image.log_time_ns, count + 1
        due = wall0 + (image.log_time_ns - first_ns) / NS_PER_S / rate
        _sleep_until(due)
        late_ms = (time.monotonic() - due) * 1000
        if clock is not None:
            bag_time = Clock()
            bag_time.clock.sec, bag_time.clock.nanosec = divmod(image.log_time_ns, NS_PER_S)
            clock.publish(bag_time)
        publishers[image.topic].publish(image.rawdata)  # a stop acts before, never between
        stats["published"][image.topic] += 1
        stats["late_ms_max"] = max(stats["late_ms_max"], round(late_ms, 3))
    if count < 2:
        return time.monotonic()
    span_s = (last_ns - first_ns) / NS_PER_S / rate
    return wall0 + span_s + span_s / (count - 1)


def _sleep_until(due: float) -> None:
    """Sleep until time.monotonic() reaches `due`, in slices, so Ctrl-C acts within a slice even
    across a long pause of the bag or a slow rate (and before every frame: at least one look)."""
    STOP.check()
    while (left := due - time.monotonic()) > 0:
        time.sleep(min(left, SLEEP_SLICE_S))
        STOP.check()


class _StopRequest:
    """A stop signal, acted on only where replay's own code looks (`check`: before each frame,
    in every sleep slice and wait, between passes), by raising KeyboardInterrupt there.

    The handler never raises itself: an exception raised at whatever line the signal lands on
    can unwind through other libraries' code. When it unwound through code the bag reader runs
    with exec (rosbags' generated deserializers, made anew for each pass), CPython marked the
    interrupt as unhandled although replay caught it, and killed itself with SIGINT at exit (rc
    -2, empty stderr: the flake of test_replay_stops_cleanly_on_sigint at the loop's wrap,
    reproduced in 4 of 12 runs). Looking only between a publish and the next one also keeps
    every publish counted."""

    def __init__(self) -> None:
        self.name = ""

    def request(self, name: str) -> None:
        self.name = self.name or name

    def check(self) -> None:
        if self.name:
            raise KeyboardInterrupt(self.name)

    def clear(self) -> None:
        self.name = ""


STOP = _StopRequest()


def stop_on_signals() -> None:
    """SIGINT and SIGTERM stop the replay cleanly: a stop request (`_StopRequest`), which
    replay_bag acts on before the next frame with a teardown and an exit code 0; a second
    signal during the (bounded) teardown is ignored.

    Set explicitly because neither Python nor rclpy does it here: a process started with SIGINT
    ignored - any background job of a non-interactive shell, as CI and scripts start them -
    keeps it ignored in Python, and rclpy installs its own handler only for the default context,
    not for replay's private one. `replay --loop` then ignored Ctrl-C for good (the test run
    that waited 60 s for it had been started in the background).
    """

    def stop(signum: int, frame) -> None:
        for ours in (signal.SIGINT, signal.SIGTERM):
            signal.signal(ours, signal.SIG_IGN)
        STOP.request(signal.Signals(signum).name)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
