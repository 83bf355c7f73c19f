"""A frame with a bad stamp, or a burst of them, sent over DDS to the running node, leaves the
memory untouched.

The stream clock rule (deltas_ros/core/frames.py) through the real node: after each attack,
the next chunks' drift is bit-identical to a clean run's, chunk indices do not restart, and
the frames are counted as bad.
"""

from __future__ import annotations

import pytest
from ros_helpers import (
    BASE_STAMP,
    Tester,
    indices,
    raw_frame,
    stamp_msg,
    start,
    status_values,
)
from ros_helpers import stop as stop_node

CAMERA_FPS, SECONDS = 10.0, 3.0  # three chunks at the node's 2 fps, 2 frames per chunk
ATTACK_AT = 14  # the attack follows frame 14 (1.4 s); frame 15 (1.5 s) fills a sampling slot
Y2038 = 2_145_916_800.0


def attack_frames(name: str) -> list:
    """The messages of one attack, sent between frames ATTACK_AT and ATTACK_AT + 1."""
    now = BASE_STAMP + ATTACK_AT / CAMERA_FPS
    if name == "stamp 0, unknown encoding":
        msg = raw_frame(ATTACK_AT, 0.0)
        msg.encoding = "yuv422_weird"
    elif name == "16UC1 stamped 1 s back":
        msg = raw_frame(ATTACK_AT, now - 1.0)
        msg.encoding = "16UC1"
    elif name == "empty frame stamped in 2038":
        msg = raw_frame(ATTACK_AT, Y2038)
        msg.height = msg.width = msg.step = 0
        msg.data = b""
    elif name == "good frame stamped +20 s":
        msg = raw_frame(ATTACK_AT, now + 20.0)
    elif name == "a 1x1000000 frame":
        msg = raw_frame(ATTACK_AT, now + 0.1)  # due for sampling: decoded, refused
        msg.encoding, msg.height, msg.width, msg.step = "mono8", 1, 1_000_000, 1_000_000
        msg.data = bytes(1_000_000)
    elif name.startswith("three frames"):  # sent back to back, within a few milliseconds
        offset = 1e7 if "+1e7" in name else -100.0
        return [raw_frame(ATTACK_AT + k, now + offset + 0.5 * k) for k in range(3)]
    else:
        raise ValueError(name)
    return [msg]


ATTACKS = ["stamp 0, unknown encoding", "16UC1 stamped 1 s back", "empty frame stamped in 2038",
           "good frame stamped +20 s", "a 1x1000000 frame", "three frames stamped +1e7 s",
           "three frames stamped 100 s back"]


@pytest.fixture(scope="module")
def node(tiny_model_dir, ros_domain):  # noqa: F811 (the fixture imported above)
    process = start(tiny_model_dir, ros_domain, reliable_qos="true")
    tester = Tester()
    try:
        tester.wait_ready(process)
        yield tester, process
    finally:
        tester.close()
        stop_node(process)


def run(tester: Tester, extra: list | None = None, first: list | None = None) -> list:
    """Reset, stream SECONDS of camera (with `extra` sent after frame ATTACK_AT, `first` before
    frame 0) and return the three chunks' DriftScores."""
    tester.reset()
    for msg in first or []:
        tester.camera.publish(msg)

    def on_frame(i: int) -> None:
        if i == ATTACK_AT:
            for msg in extra or []:
                tester.camera.publish(msg)

    tester.stream(SECONDS, fps=CAMERA_FPS, on_frame=on_frame)
    tester.wait_for(lambda: len(tester.drift) >= 3, timeout=120)
    return list(tester.drift)


@pytest.fixture(scope="module")
def clean(node) -> list:
    tester, _ = node
    run(tester)  # warm-up: a fresh process pays one-time costs on its first chunks
    return run(tester)


@pytest.mark.parametrize("attack", ATTACKS)
def test_one_bad_stamp_or_frame_leaves_the_next_chunks_identical(node, clean, attack):
    tester, process = node
    _, before = tester.last_status()

    drift = run(tester, extra=attack_frames(attack))

    sent = len(attack_frames(attack))
    status = tester.wait_for_status(
        lambda s: int(status_values(s)["frames_bad"]) >= int(before["frames_bad"]) + sent)
    values = status_values(status)
    assert process.poll() is None
    assert indices(drift) == indices(clean) == [0, 1, 2]
    assert [m.drift for m in drift] == [m.drift for m in clean]
    assert [m.stream_time for m in drift] == [m.stream_time for m in clean]
    assert values["time_jumps_back"] == before["time_jumps_back"]
    assert values["time_gaps"] == before["time_gaps"]


def test_a_zero_stamp_first_frame_does_not_start_the_stream(node, clean):
    tester, _ = node
    first = raw_frame(0, 0.0)
    first.header.stamp = stamp_msg(0.0)

    drift = run(tester, first=[first])

    assert [m.stream_time for m in drift] == [m.stream_time for m in clean]  # not ~1.7e9 s
    assert [m.drift for m in drift] == [m.drift for m in clean]
