"""~/memory_markers: where the held chunks were seen, as RViz markers (visualization_msgs).

    array = memory_markers(held, Evidence.of(answer))   # pure: held chunks with their poses
    MemoryMarkers(node, qos).chunks(held)               # after every chunk (worker thread)
    MemoryMarkers(node, qos).answered(answer)           # after every answer (executor threads)

One message says everything, so a late viewer (transient local) or a dropped message never
leaves stale markers: a DELETEALL first, then, in the frame of each chunk's pose
- `chunks`: an arrow per held chunk at its pose (its heading), coloured as the dashboard colours
  its bar: the two blue shades alternate by temporal bucket, teal is the recent window; id: the
  chunk's index, so a chunk keeps its id while it is held. Beyond MAX_ARROWS held chunks (the
  node's defaults hold ~84 at 98 tokens a chunk under `deltas`; a per-token policy can hold
  thousands of thinned ones) MAX_ARROWS of them, spread over the memory's time and stable from
  message to message (`Spread`), as the memory image shows at most 24 thumbnails: a marker
  costs ~30 us to send, so the message stays at about the image's cost;
- `labels`: its stream time as text above it, for at most MAX_LABELS of the arrows, spread the
  same way (the oldest and the newest always), so a long memory stays readable;
- `path`: a line strip through the arrows' poses (every held chunk's up to MAX_ARROWS), oldest
  first, one per frame (id: the frame's order of first appearance); a frame with one pose has
  none;
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

MAX_ARROWS = 64  # chunk arrows (and path points) per message, spread over the held chunks
MAX_LABELS = 12  # stream-time labels per message, spread over the arrows
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


class Spread:
    """At most `most` of the held chunks, spread over their time and stable from one message to
    the next, as the memory image thins its thumbnails: the chunks chosen before stay while
    held, newer ones and the oldest held join, and the inner one whose neighbours are closest in
    time leaves until `most` remain (the first choice: evenly spaced). The oldest and the
    newest held are always among them."""

    def __init__(self, most: int) -> None:
        self.most, self.chosen = most, set()

    def __call__(self, shown: list[HeldChunk]) -> list[HeldChunk]:
        newest = max((h.index for h in shown if h.index in self.chosen), default=None)
        if len(shown) <= self.most:
            picked = shown
        elif newest is None:
            picked = [shown[round(k * (len(shown) - 1) / (self.most - 1))]
                      for k in range(self.most)]
        else:
            last = len(shown) - 1
            picked = [h for i, h in enumerate(shown)
                      if h.index in self.chosen or h.index > newest or i in (0, last)]
            while len(picked) > self.most:
                del picked[min(range(1, len(picked) - 1),
                               key=lambda i: (picked[i + 1].time - picked[i - 1].time, i))]
        self.chosen = {h.index for h in picked}
        return picked


class ChunkMarkers:
    """The chunks' side of the markers, kept between messages: which chunks get an arrow and a
    label (`Spread`), and each chunk's arrow, label and path point. A message object costs
    about as much to build as to send, and a held chunk's pose never changes, so each is built
    once, when first drawn, and an arrow only takes its bucket's colour again. Keyed by index
    and time, checked against the pose (a reset or a load reuses indices); chunks no longer
    held are forgotten."""

    def __init__(self, most_arrows: int = MAX_ARROWS, most_labels: int = MAX_LABELS) -> None:
        self.arrowed, self.labelled = Spread(most_arrows), Spread(most_labels)
        self.built: dict[str, dict[tuple[int, float], tuple[Pose, Marker | Point]]] = {
            "arrow": {}, "label": {}, "point": {}}
        self.colours = {c: rgba(c) for c in (BUCKET_EVEN, BUCKET_ODD, RECENT)}

    def markers(self, shown: list[HeldChunk]
                ) -> tuple[list[HeldChunk], list[Marker], list[Marker]]:
        """(the chunks with an arrow, their arrows, the labels) of the placed held chunks
        `shown`, oldest first."""
        held = {(h.index, h.time) for h in shown}
        for built in self.built.values():
            for gone in built.keys() - held:
                del built[gone]
        chosen = self.arrowed(shown)
        arrows = [self._made("arrow", h) for h in chosen]
        for arrow, h in zip(arrows, chosen):
            arrow.color = self.colours[chunk_colour(h.bucket)]
        return chosen, arrows, [self._made("label", h) for h in self.labelled(chosen)]

    def point(self, h: HeldChunk) -> Point:
        return self._made("point", h)

    def _made(self, kind: str, h: HeldChunk) -> Marker | Point:
        built = self.built[kind]
        pose, made = built.get((h.index, h.time), (None, None))
        if pose is not h.pose and pose != h.pose:
            made = self._make(kind, h)
            built[(h.index, h.time)] = (h.pose, made)
        return made

    def _make(self, kind: str, h: HeldChunk) -> Marker | Point:
        if kind == "arrow":
            return marker("chunks", h.index, Marker.ARROW, h.pose, ARROW, self.colours[RECENT])
        if kind == "label":
            return marker("labels", h.index, Marker.TEXT_VIEW_FACING, h.pose,
                          (0.0, 0.0, LABEL_M), rgba(TEXT), f"{h.time:.1f}s", LIFT_M)
        x, y, z = h.pose.position
        return Point(x=x, y=y, z=z)


def memory_markers(held: Sequence[HeldChunk], evidence: Evidence | None = None,
                   chunks: ChunkMarkers | None = None) -> MarkerArray:
    """The MarkerArray of the held chunks (oldest first) and the latest answer's evidence;
    `chunks`: the chunks' markers kept from the last call (none: made anew)."""
    chunks = ChunkMarkers() if chunks is None else chunks
    shown = [h for h in held if placed(h.pose)]
    chosen, arrows, labels = chunks.markers(shown)
    markers = [Marker(action=Marker.DELETEALL), *arrows, *labels]
    frames: dict[str, list[Point]] = {}
    for h in chosen:
        frames.setdefault(h.pose.frame_id, []).append(chunks.point(h))
    for k, (frame, points) in enumerate(frames.items()):
        if len(points) >= 2:
            path = marker("path", k, Marker.LINE_STRIP, Pose(frame, (0.0, 0.0, 0.0)),
                          (PATH_M, 0.0, 0.0), rgba(PATH, 0.8))
            path.points = points
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
        self.parts = ChunkMarkers()

    def chunks(self, held: Sequence[HeldChunk]) -> None:
        with self.lock:
            self.held = list(held)
            self.publisher.publish(memory_markers(self.held, self.evidence, chunks=self.parts))

    def answered(self, answer: Answer) -> None:
        if answer.cancelled:
            return
        with self.lock:
            self.evidence = Evidence.of(answer)
            self.publisher.publish(memory_markers(self.held, self.evidence, chunks=self.parts))
