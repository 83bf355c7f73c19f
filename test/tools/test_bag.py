"""The synth camera stream and its rosbag2 bags: readable by rclpy and `deltas_ros.tools.bag`,
exact stamps, round-tripping pixels, events that really are in the pixels, and clear errors."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest

from deltas_ros.tools.bag import BagImage, image_topics, load_events, read_images
from deltas_ros.tools.cli import main
from deltas_ros.training.synth import synth_stream, write_synth_bag

DURATION, FPS, WIDTH, HEIGHT = 4.0, 10.0, 160, 120
START = 1_700_000_000.25  # a fractional start: nanosec must carry the .25 exactly
SYNTH = {"duration_s": DURATION, "fps": FPS, "width": WIDTH, "height": HEIGHT, "seed": 3}
EVERY = 1.5


def expected_stamp(index: int) -> tuple[int, int]:
    """start + index/fps for fps 10, in integers: what the header must say."""
    return divmod(1_700_000_000 * 10**9 + 250_000_000 + index * 100_000_000, 10**9)


@pytest.fixture(
    scope="module",
    params=[("mcap", "rgb8"), ("sqlite3", "rgb8"), ("mcap", "jpeg"), ("sqlite3", "jpeg")],
    ids=lambda p: "-".join(p),
)
def bag(request, tmp_path_factory):
    storage, encoding = request.param
    path = tmp_path_factory.mktemp("bags") / f"synth_{storage}_{encoding}"
    write_synth_bag(
        path, storage=storage, encoding=encoding, start_stamp=START, event_every_s=EVERY, **SYNTH
    )
    return path, storage, encoding


def test_bag_decodes_with_rclpy_with_exact_stamps_and_pixels(bag):
    from rclpy.serialization import deserialize_message
    from sensor_msgs.msg import CompressedImage, Image

    path, _, encoding = bag
    frames, _ = synth_stream(event_every_s=EVERY, **SYNTH)
    images = list(read_images(path))
    assert len(images) == DURATION * FPS
    for index, (image, (time_s, frame)) in enumerate(zip(images, frames)):
        assert isinstance(image, BagImage)
        msg = deserialize_message(image.rawdata, Image if encoding == "rgb8" else CompressedImage)
        sec, nanosec = expected_stamp(index)
        assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (sec, nanosec)
        assert image.log_time_ns == sec * 10**9 + nanosec
        assert image.stamp == pytest.approx(START + time_s, abs=1e-6)
        assert msg.header.frame_id == "camera"
        if encoding == "rgb8":
            assert (msg.height, msg.width, msg.encoding, msg.step) == (HEIGHT, WIDTH, "rgb8", 480)
            pixels = np.frombuffer(bytes(msg.data), np.uint8).reshape(HEIGHT, WIDTH, 3)
            np.testing.assert_array_equal(pixels, frame)
            np.testing.assert_array_equal(image.message.data, frame.reshape(-1))
        else:
            assert msg.format == "jpeg"
            decoded = cv2.imdecode(np.frombuffer(bytes(msg.data), np.uint8), cv2.IMREAD_COLOR)
            assert np.abs(decoded[..., ::-1].astype(int) - frame).mean() < 6


def test_sidecar_lists_events_inside_the_stream(bag):
    path, _, encoding = bag
    sidecar = json.loads((path / "events.json").read_text())
    assert sidecar["topic"] == "/camera/image_raw"
    assert (sidecar["fps"], sidecar["duration_s"]) == (FPS, DURATION)
    assert sidecar["start_stamp"] == START
    assert (sidecar["width"], sidecar["height"], sidecar["encoding"]) == (WIDTH, HEIGHT, encoding)
    events = load_events(path)
    assert events == sidecar["events"] and events
    for event in events:
        assert 0 < event["time"] <= event["end"] <= DURATION
        assert event["kind"] in ("object", "cut") and event["label"]
    assert image_topics(path) == {
        "/camera/image_raw": "sensor_msgs/msg/Image"
        if encoding == "rgb8"
        else "sensor_msgs/msg/CompressedImage"
    }


def test_stream_is_deterministic_for_a_seed():
    def run(seed):
        frames, events = synth_stream(3.0, 5.0, 64, 48, seed=seed, event_every_s=1.0)
        return np.stack([frame for _, frame in frames]), events

    first, again, other = run(7), run(7), run(8)
    np.testing.assert_array_equal(first[0], again[0])
    assert first[1] == again[1]
    assert not np.array_equal(first[0], other[0])


def test_events_change_pixels_far_more_than_still_periods():
    frames, events = synth_stream(40.0, 5.0, 160, 120, seed=1, event_every_s=5.0)
    times, stack = zip(*frames)
    # diffs[i]: frame i -> i + 1
    diffs = [np.abs(b.astype(int) - a).mean() for a, b in zip(stack, stack[1:])]
    # A scene changes between frame i and i+1 when a boundary lies in (t_i, t_{i+1}].
    boundaries = [t for e in events for t in {e["time"], e["end"]}]
    changing = {i for i in range(len(diffs)) for t in boundaries if times[i] < t <= times[i + 1]}
    objects = [e for e in events if e["kind"] == "object"]
    assert len(objects) >= 3 and any(e["kind"] == "cut" for e in events)
    still = max(d for i, d in enumerate(diffs) if i not in changing)
    at_events = min(diffs[i] for i in changing)
    assert still < 4
    assert at_events > 5 * still
    # Each object covers at least 1/6 of the frame while it is visible.
    for event in objects:
        first = next(i for i, t in enumerate(times) if t >= event["time"])
        changed = np.abs(stack[first].astype(int) - stack[first - 1]).max(axis=2) > 30
        assert changed.mean() > 1 / 6 * 0.9, event


def test_read_images_rejects_missing_and_non_bags(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_images(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="plain"):
        read_images(tmp_path / "plain")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metadata.yaml").write_text("rosbag2_bagfile_information: [\n")
    with pytest.raises(ValueError, match="broken"):
        read_images(tmp_path / "broken")


def test_read_images_rejects_bags_without_those_image_topics(tmp_path):
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    typestore = get_typestore(Stores.ROS2_KILTED)
    path = tmp_path / "strings"
    with Writer(path, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        connection = writer.add_connection("/chatter", "std_msgs/msg/String", typestore=typestore)
        message = typestore.types["std_msgs/msg/String"](data="hello")
        writer.write(connection, 1, typestore.serialize_cdr(message, "std_msgs/msg/String"))
    assert image_topics(path) == {}
    with pytest.raises(ValueError, match="no Image"):
        read_images(path)
    assert load_events(path) is None

    synth = write_synth_bag(tmp_path / "synth", duration_s=1.0, fps=5.0, width=32, height=24)
    with pytest.raises(ValueError, match="/depth"):
        read_images(synth, ["/depth"])
    assert len(list(read_images(synth, ["/camera/image_raw"]))) == 5


def test_write_refuses_to_overwrite(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        write_synth_bag(tmp_path / "taken", duration_s=1.0, fps=5.0, width=32, height=24)
    assert list((tmp_path / "taken").iterdir()) == []


def test_synth_command_prints_path_and_events(tmp_path, capsys):
    out = tmp_path / "cli_bag"
    argv = ["synth", str(out), "--duration", "12", "--fps", "5", "--width", "64", "--height", "48"]
    assert main([*argv, "--encoding", "jpeg", "--storage", "sqlite3"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed
    events = load_events(out)
    assert events and all(event["label"] in printed for event in events)
    assert main(argv) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_synth_busy_over_ten_minutes_writes_the_hour_world(tmp_path, capsys):
    """`deltas-ros synth --busy --duration 3600`: an hour of 5-minute parts at the busy world's
    density (8 objects every 2 minutes) over more identities than the busy world's 24."""
    out = tmp_path / "hour"
    assert main(["synth", str(out), "--busy", "--duration", "3600", "--fps", "0.5", "--width",
                 "64", "--height", "48", "--encoding", "jpeg"]) == 0
    objects = [e for e in load_events(out) if e["kind"] == "object"]
    assert len(objects) == 240
    identities = {(e["colour"], e["shape"]) for e in objects}
    assert len(identities) > 24
    assert any(e["time"] > 3300 for e in objects) and any(e["time"] < 300 for e in objects)
