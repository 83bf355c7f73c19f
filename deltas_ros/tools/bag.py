"""Reading camera images from a rosbag2 directory (MCAP or sqlite3) with `rosbags`, without rclpy.

Offline runs and tests read recorded or generated camera streams here; `deltas-ros replay` hands
ros/replay.py a `BagImages`, whose passes it republishes as the raw CDR bytes kept in each
`BagImage`, so a live subscriber sees exactly what was recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rosbags.rosbag2 import Reader, ReaderError
from rosbags.typesys import Stores, get_typestore

from ..training.synth import EVENTS_FILE

IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")


@dataclass
class BagImage:
    """One image message as stored, with its decoded form for offline use."""

    topic: str
    msgtype: str
    stamp: float  # header stamp, s
    log_time_ns: int  # bag (receive) time, the clock replay follows
    rawdata: bytes  # the CDR bytes exactly as stored
    message: object  # deserialized by rosbags (data is a numpy uint8 array)


@contextmanager
def _open(path: str | Path) -> Iterator[Reader]:
    """An open Reader, with missing or unreadable bags reported by path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such bag: {path}")
    if not (path / "metadata.yaml").is_file():
        raise ValueError(f"not a rosbag2 directory (no metadata.yaml): {path}")
    try:
        reader = Reader(path)
        reader.open()
    except (ReaderError, OSError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read bag {path}: {error}") from error
    try:
        yield reader
    except ReaderError as error:
        raise ValueError(f"cannot read bag {path}: {error}") from error
    finally:
        reader.close()


def message_count(path: str | Path, topic: str) -> int:
    """How many messages the bag holds on `topic` (from its index, nothing decoded)."""
    with _open(path) as reader:
        return sum(c.msgcount for c in reader.connections if c.topic == topic)


def _image_connections(reader: Reader) -> dict[str, str]:
    return {c.topic: c.msgtype for c in reader.connections if c.msgtype in IMAGE_TYPES}


def image_topics(path: str | Path) -> dict[str, str]:
    """Topic -> message type of the bag's Image and CompressedImage topics (maybe empty)."""
    with _open(path) as reader:
        return _image_connections(reader)


@dataclass(frozen=True)
class BagImages:
    """Chosen image topics of a bag, read afresh on each pass (a looping replay takes several)."""

    path: Path
    topics: dict[str, str]  # topic -> message type

    def images(self) -> Iterator[BagImage]:
        """One pass over the topics' messages in log-time order."""
        return _messages(self.path, set(self.topics))


def open_images(path: str | Path, topics: list[str] | None = None) -> BagImages:
    """The bag's image topics (all, or `topics`), checked before any message is read:
    FileNotFoundError / ValueError, naming the path, for a missing or unreadable bag, a bag
    without image topics, or a requested topic that is not one of its image topics."""
    available = image_topics(path)
    if not available:
        raise ValueError(f"no Image or CompressedImage topic in bag {path}")
    missing = sorted(set(topics or ()) - set(available))
    if missing:
        raise ValueError(f"not image topics of bag {path}: {missing} (it has {sorted(available)})")
    return BagImages(Path(path), {topic: available[topic] for topic in topics or available})


def read_images(path: str | Path, topics: list[str] | None = None) -> Iterator[BagImage]:
    """The bag's image messages (all image topics, or `topics`) in log-time order, the bag
    checked first (open_images)."""
    return open_images(path, topics).images()


def _messages(path: str | Path, topics: set[str]) -> Iterator[BagImage]:
    typestore = get_typestore(Stores.ROS2_KILTED)
    with _open(path) as reader:
        connections = [
            c for c in reader.connections if c.topic in topics and c.msgtype in IMAGE_TYPES
        ]
        for connection, log_time_ns, rawdata in reader.messages(connections=connections):
            message = typestore.deserialize_cdr(rawdata, connection.msgtype)
            stamp = message.header.stamp
            yield BagImage(
                topic=connection.topic,
                msgtype=connection.msgtype,
                stamp=stamp.sec + stamp.nanosec * 1e-9,
                log_time_ns=log_time_ns,
                rawdata=bytes(rawdata),
                message=message,
            )


def load_events(path: str | Path) -> list[dict] | None:
    """The events of a synth bag (its `events.json` sidecar), or None for other bags."""
    sidecar = Path(path) / EVENTS_FILE
    if not sidecar.is_file():
        return None
    return json.loads(sidecar.read_text())["events"]
