"""~/memory_markers: where the held chunks were seen, as RViz markers (visualization_msgs).

    array = memory_markers(held, Evidence.of(answer))   # pure: held chunks with their poses
    MemoryMarkers(node, qos).chunks(held)               # after every chunk (worker thread)
    MemoryMarkers(node, qos).answered(answer)           # after every answer (executor threads)

One message says everything, so a late viewer (transient local) or a dropped message never
leaves stale markers: a DELETEALL first, then, in the frame of each chunk's pose
- `chunks`: an arrow per held chunk at its pose (its heading), coloured as the dashboard colours
  its bar: the two blue shades alternate by temporal bucket, teal is the recent window; id: the
  chunk's index, so a chunk keeps its id while it is held;
- `labels`: its stream time as text above it, for at most MAX_LABELS chunks evenly spaced over
  the held ones (the oldest and the newest always), so a long memory stays readable;
- `path`: a line strip through the held chunks' poses, oldest first, one per frame (id: the
  frame's order of first appearance); a frame with one pose has none;
- `evidence` and `answer`: the latest answer's evidence chunks, larger and orange, each labelled
  with its stream time and the answer (at most ANSWER_CHARS), until the next answer (a
  cancelled one replaces nothing: its text is partial and its caller has gone).
Chunks without a pose, or whose pose names no frame (RViz could not place it), are shown by
nothing. Stamps are zero: RViz takes the newest transform, where a chunk's own stamp (minutes
old) would be past tf's buffer whenever the fixed frame is another one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from geometry_msgs.msg import Point
from rclpy.node import Node
from rclpy.qos import QoSProfile
from std_msgs.msg import ColorRGBA
from visualization_msgs.msg import Marker, MarkerArray

from ..core.poses import Pose
from ..core.results import Answer, HeldChunk

MAX_LABELS = 12  # stream-time labels per message, evenly spaced over the held chunks
ANSWER_CHARS = 60  # of the answer on each evidence label
ID_LIMIT = 2**31  # Marker.id is an int32; a chunk's index wraps past it
ARROW = (0.4, 0.08, 0.08)  # length, shaft and head diameter (m)
EVIDENCE_SCALE = 2.5  # evidence arrows are this much larger
LABEL_M, ANSWER_M = 0.15, 0.25  # text heights (m)
LIFT_M = 0.3  # labels sit this far above their pose
PATH_M = 0.03  # line width of the path


def rgba(hex_colour: str, alpha: float = 0.9) -> ColorRGBA:
    """A ColorRGBA of "#rrggbb" (the dashboard's colours)."""
    r, g, b = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return ColorRGBA(r=r, g=g, b=b, a=alpha)


BUCKET_EVEN, BUCKET_ODD = "#4a7bd0", "#8db0ea"  # dashboard.html: .bar, .bar.odd
RECENT, EVIDENCE = "#2a9d8f", "#e0662b"  # .bar.recent, .bar.evidence
PATH, TEXT = "#9a9a9a", "#f0f0f0"


@dataclass(frozen=True)
class Evidence:
    """What the markers keep of an answer: its text, cut to a label, and its evidence."""

    text: str
    times: tuple[float, ...]
    poses: tuple[Pose | None, ...]

    @classmethod
    def of(cls, answer: Answer) -> Evidence:
        text = " ".join(answer.text.split())
        if len(text) > ANSWER_CHARS:
            text = text[:ANSWER_CHARS - 1] + "…"
        poses = answer.evidence_poses or [None] * len(answer.evidence_times)
        return cls(text, tuple(float(t) for t in answer.evidence_times), tuple(poses))


def chunk_colour(bucket: int) -> str:
    """The dashboard's colour of a chunk in `bucket` (-1: the recent window)."""
    return RECENT if bucket < 0 else BUCKET_ODD if bucket % 2 else BUCKET_EVEN


def labelled(count: int, most: int = MAX_LABELS) -> set[int]:
    """Positions (0..count-1) of the chunks to label: all of them, or `most` evenly spaced,
    the first and the last among them."""
    if count <= most:
        return set(range(count))
    return {round(k * (count - 1) / (most - 1)) for k in range(most)}


def placed(pose: Pose | None) -> bool:
    """Whether RViz can place `pose`: known, in a named frame."""
    return pose is not None and bool(pose.frame_id)


def marker(ns: str, id_: int, kind: int, pose: Pose, scale: Sequence[float],
           colour: ColorRGBA, text: str = "", lift: float = 0.0) -> Marker:
    """One ADD marker at `pose` (its orientation too unless lifted: text faces the viewer)."""
    m = Marker(ns=ns, id=id_ % ID_LIMIT, type=kind, action=Marker.ADD, color=colour, text=text)
    m.header.frame_id = pose.frame_id
    p = m.pose.position
    p.x, p.y, p.z = pose.position[0], pose.position[1], pose.position[2] + lift
    if not lift:
        q = m.pose.orientation
        q.x, q.y, q.z, q.w = pose.orientation
    m.scale.x, m.scale.y, m.scale.z = scale
    return m


def memory_markers(held: Sequence[HeldChunk], evidence: Evidence | None = None,
                   most_labels: int = MAX_LABELS) -> MarkerArray:
    """The MarkerArray of the held chunks (oldest first) and the latest answer's evidence."""
    markers = [Marker(action=Marker.DELETEALL)]
    shown = [h for h in held if placed(h.pose)]
    text_colour = rgba(TEXT)
    for h in shown:
        markers.append(marker("chunks", h.index, Marker.ARROW, h.pose, ARROW,
                              rgba(chunk_colour(h.bucket))))
    for k in sorted(labelled(len(shown), most_labels)):
        h = shown[k]
        markers.append(marker("labels", h.index, Marker.TEXT_VIEW_FACING, h.pose,
                              (0.0, 0.0, LABEL_M), text_colour, f"{h.time:.1f}s", LIFT_M))
    frames: dict[str, list[Pose]] = {}
    for h in shown:
        frames.setdefault(h.pose.frame_id, []).append(h.pose)
    for k, poses in enumerate(frames.values()):
        if len(poses) >= 2:
            path = marker("path", k, Marker.LINE_STRIP, Pose(poses[0].frame_id, (0, 0, 0)),
                          (PATH_M, 0.0, 0.0), rgba(PATH, 0.8))
            path.points = [Point(x=p.position[0], y=p.position[1], z=p.position[2])
                           for p in poses]
            markers.append(path)
    if evidence is not None:
        big = tuple(s * EVIDENCE_SCALE for s in ARROW)
        for k, (t, pose) in enumerate(zip(evidence.times, evidence.poses)):
            if placed(pose):
                markers.append(marker("evidence", k, Marker.ARROW, pose, big, rgba(EVIDENCE)))
                label = f"{t:.1f}s: {evidence.text}" if evidence.text else f"{t:.1f}s"
                markers.append(marker("answer", k, Marker.TEXT_VIEW_FACING, pose,
                                      (0.0, 0.0, ANSWER_M), rgba(EVIDENCE, 1.0), label,
                                      2 * LIFT_M))
    return MarkerArray(markers=markers)


class MemoryMarkers:
    """~/memory_markers of `node`: republished whole after every chunk and every answer. The
    held chunks and the answer are kept between the two (worker and executor threads: one
    lock, so the messages go out in the order of their state)."""

    def __init__(self, node: Node, qos: QoSProfile) -> None:
        self.publisher = node.create_publisher(MarkerArray, "~/memory_markers", qos)
        self.lock = threading.Lock()
        self.held: list[HeldChunk] = []
        self.evidence: Evidence | None = None

    def chunks(self, held: Sequence[HeldChunk]) -> None:
        with self.lock:
            self.held = list(held)
            self.publisher.publish(memory_markers(self.held, self.evidence))

    def answered(self, answer: Answer) -> None:
        if answer.cancelled:
            return
        with self.lock:
            self.evidence = Evidence.of(answer)
            self.publisher.publish(memory_markers(self.held, self.evidence))
