"""A generated camera stream with known events, and a rosbag2 writer for it (no rclpy needed).

Tests, demos and benchmarks need long camera streams whose content is known: mostly still scenes
(a static textured background plus mild sensor noise) broken by occasional distinct events, either
an object that appears for 1-3 s or a cut to a new view. The events are returned alongside the
frames and written as `events.json` inside the bag directory, so a consumer can be scored against
them.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from .palette import COLOURS, NOISE_AMPLITUDE, NOISE_BANK, SHAPES, TINTS, background
from .scenes import SceneOptions, scene_stream

NS_PER_S = 1_000_000_000
EVENTS_FILE = "events.json"  # the known events, beside the bag's files
CUT_PROBABILITY = 0.3


def stamp_ns(start_stamp: float, index: int, fps: float) -> int:
    """Time of frame `index` in integer ns: start_stamp + index/fps without float drift."""
    sec = math.floor(start_stamp)
    start = sec * NS_PER_S + round((start_stamp - sec) * NS_PER_S)
    return start + round(Fraction(index * NS_PER_S) / Fraction(fps))

def _draw_object(
    image: np.ndarray, rng: np.random.Generator, shape: str, colour: str
) -> np.ndarray:
    """The scene with a filled, outlined shape covering 1/6 to 1/4 of the frame area."""
    height, width = image.shape[:2]
    area = rng.uniform(1 / 6, 1 / 4) * width * height
    # Side of the bounding square that gives this area for each shape, capped to the frame.
    factor = {"circle": 4 / math.pi, "square": 1.0, "triangle": 2.0}[shape]
    side = min(int(math.ceil(math.sqrt(area * factor))), width, height)
    x0 = int(rng.integers(0, width - side + 1))
    y0 = int(rng.integers(0, height - side + 1))
    out = image.copy()
    if shape == "circle":
        centre, radius = (x0 + side // 2, y0 + side // 2), side // 2
        cv2.circle(out, centre, radius, COLOURS[colour], -1, cv2.LINE_AA)
        cv2.circle(out, centre, radius, (0, 0, 0), 2, cv2.LINE_AA)
        return out
    x1, y1 = x0 + side - 1, y0 + side - 1
    if shape == "square":
        corners = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    else:
        corners = [(x0 + side // 2, y0), (x1, y1), (x0, y1)]
    points = np.array(corners, dtype=np.int32)
    cv2.fillPoly(out, [points], COLOURS[colour], cv2.LINE_AA)
    cv2.polylines(out, [points], True, (0, 0, 0), 2, cv2.LINE_AA)
    return out


def synth_stream(
    duration_s: float,
    fps: float,
    width: int,
    height: int,
    seed: int = 0,
    event_every_s: float = 8.0,
) -> tuple[Iterator[tuple[float, np.ndarray]], list[dict]]:
    """Frames (time_s, RGB uint8 HxWx3), generated lazily, and the events they contain.

    Events start roughly every `event_every_s` (jittered, never overlapping, all inside the
    duration). An "object" event spans its visible interval; a "cut" has end == time, the moment
    the view changes for the rest of the stream. Everything is deterministic from `seed`.
    """
    if duration_s <= 0 or fps <= 0 or width < 8 or height < 8 or event_every_s <= 0:
        raise ValueError("synth_stream needs duration, fps, event spacing > 0 and a frame >= 8x8")
    rng = np.random.default_rng(seed)
    tint = "grey"
    view = background(rng, width, height, tint)
    # The piecewise-constant scene: segment start times and the image shown from then on.
    starts, scenes = [0.0], [view]
    events: list[dict] = []
    nominal, last_end = event_every_s, 0.0
    while True:
        # Times in ms: the published event times are exactly where the scenes change.
        start = round(max(nominal + rng.uniform(-0.2, 0.2) * event_every_s, last_end + 0.5), 3)
        kind = "cut" if events and rng.random() < CUT_PROBABILITY else "object"
        if kind == "object":
            end = round(start + rng.uniform(1.0, 3.0), 3)
            if end > duration_s:
                break
            shape = SHAPES[rng.integers(len(SHAPES))]
            colour = list(COLOURS)[rng.integers(len(COLOURS))]
            label = f"{colour} {shape}"
            starts += [start, end]
            scenes += [_draw_object(view, rng, shape, colour), view]
        else:
            end = start
            if end >= duration_s:
                break
            tint = str(rng.choice([name for name in TINTS if name != tint]))
            label = f"cut to a {tint} scene"
            view = background(rng, width, height, tint)
            starts.append(start)
            scenes.append(view)
        events.append({"time": start, "end": end, "kind": kind, "label": label})
        last_end, nominal = end, nominal + event_every_s
    noise = rng.integers(
        -NOISE_AMPLITUDE, NOISE_AMPLITUDE + 1, size=(NOISE_BANK, height, width, 3), dtype=np.int16
    )
    frame_count = round(duration_s * fps)
    noise_picks = rng.integers(NOISE_BANK, size=frame_count)

    def frames() -> Iterator[tuple[float, np.ndarray]]:
        for index in range(frame_count):
            time_s = index / fps
            scene = scenes[bisect.bisect_right(starts, time_s) - 1]
            frame = np.clip(scene + noise[noise_picks[index]], 0, 255).astype(np.uint8)
            yield time_s, frame

    return frames(), events


def write_synth_bag(
    path: str | Path,
    duration_s: float = 30.0,
    fps: float = 30.0,
    width: int = 640,
    height: int = 480,
    encoding: str = "rgb8",
    storage: str = "mcap",
    topic: str = "/camera/image_raw",
    frame_id: str = "camera",
    seed: int = 0,
    start_stamp: float = 1_700_000_000.0,
    event_every_s: float = 8.0,
    scenes: SceneOptions | None = None,
) -> Path:
    """Write a synth stream as a rosbag2 directory that ROS 2 Kilted tools and rclpy can read.

    scenes: write a scene stream (`scene_stream`, what the shipped model knows) instead of a
    `synth_stream`; event_every_s is then unused.

    encoding "rgb8" writes sensor_msgs/msg/Image, "jpeg" sensor_msgs/msg/CompressedImage (the
    caller picks the topic; ROS convention appends "/compressed"). Header stamps and log times are
    start_stamp + i/fps. The events, with the stream's parameters, go to `events.json` inside it.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"refusing to overwrite existing path: {path}")
    if encoding not in ("rgb8", "jpeg"):
        raise ValueError(f"encoding must be 'rgb8' or 'jpeg', not {encoding!r}")
    plugins = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
    if storage not in plugins:
        raise ValueError(f"storage must be 'mcap' or 'sqlite3', not {storage!r}")
    if scenes is None:
        frames, events = synth_stream(duration_s, fps, width, height, seed, event_every_s)
    else:
        frames, events = scene_stream(duration_s, fps, width, height, seed, scenes)

    typestore = get_typestore(Stores.ROS2_KILTED)
    types = typestore.types
    msgtype = "sensor_msgs/msg/Image" if encoding == "rgb8" else "sensor_msgs/msg/CompressedImage"
    # Bag version 9 is what Kilted's rosbag2 writes; rclpy deserializes these messages as is.
    with Writer(path, version=9, storage_plugin=plugins[storage]) as writer:
        connection = writer.add_connection(topic, msgtype, typestore=typestore)
        for index, (_, frame) in enumerate(frames):
            time_ns = stamp_ns(start_stamp, index, fps)
            stamp = types["builtin_interfaces/msg/Time"](
                sec=time_ns // NS_PER_S, nanosec=time_ns % NS_PER_S
            )
            header = types["std_msgs/msg/Header"](stamp=stamp, frame_id=frame_id)
            if encoding == "rgb8":
                message = types[msgtype](
                    header=header,
                    height=height,
                    width=width,
                    encoding="rgb8",
                    is_bigendian=0,
                    step=3 * width,
                    data=frame.reshape(-1),
                )
            else:
                ok, jpeg = cv2.imencode(".jpg", frame[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])
                if not ok:
                    raise RuntimeError("OpenCV failed to encode a JPEG frame")
                message = types[msgtype](header=header, format="jpeg", data=jpeg.reshape(-1))
            writer.write(connection, time_ns, typestore.serialize_cdr(message, msgtype))

    sidecar = {
        "topic": topic,
        "fps": fps,
        "duration_s": duration_s,
        "start_stamp": start_stamp,
        "width": width,
        "height": height,
        "encoding": encoding,
        "events": events,
    }
    (path / EVENTS_FILE).write_text(json.dumps(sidecar, indent=2) + "\n")
    return path
