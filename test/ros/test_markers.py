"""~/memory_markers' builder without DDS: one arrow per placed held chunk in its pose's frame,
the dashboard's colours, DELETEALL first, stable ids, bounded labels, the path, the latest
answer's evidence, and nothing for chunks without a pose."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from visualization_msgs.msg import Marker

from deltas_ros.core.poses import Pose
from deltas_ros.core.results import Answer, HeldChunk
from deltas_ros.ros.markers import (
    ANSWER_CHARS,
    ARROW,
    BUCKET_EVEN,
    BUCKET_ODD,
    EVIDENCE,
    MAX_ARROWS,
    MAX_LABELS,
    RECENT,
    ChunkMarkers,
    Evidence,
    MemoryMarkers,
    memory_markers,
    rgba,
)
from deltas_ros.ros.memory_io import MemoryView


def posed(index: int, bucket: int = 0, frame: str = "map") -> HeldChunk:
    """Held chunk `index` at stream time index + 0.5, at x = index, facing +y."""
    return HeldChunk(index, index + 0.5, 10, bucket,
                     Pose(frame, (float(index), 2.0, 0.0), (0.0, 0.0, 0.7071068, 0.7071068)))


def of(array, ns: str) -> list[Marker]:
    return [m for m in array.markers if m.ns == ns]


def answer(text: str, times: list[float], poses: list[Pose | None],
           cancelled: bool = False) -> Answer:
    return Answer(text=text, evidence_times=times, evidence_stamps=[None] * len(times),
                  memory_tokens=100, span_start=0.0, span_end=10.0, latency_ms=5.0,
                  generated_tokens=3, cancelled=cancelled, evidence_poses=poses)


def test_deleteall_first_then_an_arrow_per_placed_chunk_at_its_pose_in_its_frame():
    held = [posed(0), HeldChunk(1, 1.5, 10, 0), posed(2, frame="odom"),
            HeldChunk(3, 3.5, 10, 0, Pose("", (1.0, 1.0, 0.0))), posed(4)]
    array = memory_markers(held)
    assert array.markers[0].action == Marker.DELETEALL
    assert all(m.action == Marker.ADD for m in array.markers[1:])
    arrows = of(array, "chunks")  # no pose, or a pose in no frame: nothing
    assert [m.id for m in arrows] == [0, 2, 4]
    assert [m.header.frame_id for m in arrows] == ["map", "odom", "map"]
    assert all(m.type == Marker.ARROW for m in arrows)
    assert all(m.header.stamp.sec == m.header.stamp.nanosec == 0 for m in array.markers)
    p, q = arrows[2].pose.position, arrows[2].pose.orientation
    assert (p.x, p.y, p.z) == (4.0, 2.0, 0.0)
    assert (q.x, q.y, q.z, q.w) == pytest.approx((0.0, 0.0, 0.7071068, 0.7071068))
    assert (arrows[0].scale.x, arrows[0].scale.y, arrows[0].scale.z) == ARROW


def test_chunks_are_coloured_by_bucket_as_the_dashboard_colours_them():
    arrows = of(memory_markers([posed(0, 0), posed(1, 1), posed(2, 2), posed(3, -1)]), "chunks")
    assert [m.color for m in arrows] == [rgba(BUCKET_EVEN), rgba(BUCKET_ODD), rgba(BUCKET_EVEN),
                                         rgba(RECENT)]
    assert rgba("#2a9d8f").g == pytest.approx(0x9d / 255)


def test_a_chunk_keeps_its_ids_while_it_is_held():
    """The memory moves on (chunk 1 evicted, 5 added, buckets shift): the chunks still held
    keep their namespace and id; an index past int32 wraps instead of failing."""
    before = memory_markers([posed(0), posed(1), posed(2), posed(3, -1)])
    after = memory_markers([posed(0), posed(2, 1), posed(3), posed(5, -1)])
    ids = {(m.ns, m.id) for m in of(after, "chunks")} & {(m.ns, m.id) for m in of(before,
                                                                                "chunks")}
    assert ids == {("chunks", 0), ("chunks", 2), ("chunks", 3)}
    assert len({(m.ns, m.id) for m in after.markers[1:]}) == len(after.markers) - 1
    assert of(memory_markers([posed(2**31 + 7)]), "chunks")[0].id == 7


def test_labels_every_chunk_of_a_small_memory_and_at_most_a_few_of_a_large_one():
    small = of(memory_markers([posed(i) for i in range(5)]), "labels")
    assert [m.text for m in small] == ["0.5s", "1.5s", "2.5s", "3.5s", "4.5s"]
    assert all(m.type == Marker.TEXT_VIEW_FACING and m.pose.position.z > 0 for m in small)
    large = of(memory_markers([posed(i) for i in range(200)]), "labels")
    assert len(large) == MAX_LABELS
    ids = [m.id for m in large]
    assert ids[0] == 0 and ids[-1] == 199 and ids == sorted(ids)
    gaps = [b - a for a, b in zip(ids, ids[1:])]
    assert max(gaps) <= 2 * min(gaps)  # spread over the memory


def test_a_large_memory_gets_a_bounded_spread_of_arrows_and_the_path_through_them():
    held = [posed(i) for i in range(1000)]
    array = memory_markers(held)
    ids = [m.id for m in of(array, "chunks")]
    assert len(ids) == MAX_ARROWS and ids[0] == 0 and ids[-1] == 999
    gaps = [b - a for a, b in zip(ids, ids[1:])]
    assert max(gaps) <= 2 * min(gaps)
    assert [p.x for p in of(array, "path")[0].points] == [float(i) for i in ids]


def test_kept_chunk_markers_stay_spread_recoloured_and_follow_a_reset():
    """As the node uses it: one ChunkMarkers across messages. A chunk drawn before is drawn
    again while held, by the same marker, in its current bucket's colour; the newest joins;
    evicted chunks go; a reused index at another pose (a reset) gets a marker there."""
    kept = ChunkMarkers(most_arrows=10, most_labels=4)
    first = of(memory_markers([posed(i, 0) for i in range(50)], chunks=kept), "chunks")
    later = [posed(i, 1 if i < 60 else -1) for i in range(5, 61)]  # 0-4 evicted, 60 new
    second = of(memory_markers(later, chunks=kept), "chunks")
    assert len(second) == 10 and second[0].id == 5 and second[-1].id == 60
    before = {m.id: m for m in first}
    kept_ids = [m.id for m in second if m.id in before]
    assert len(kept_ids) >= 7  # stable: most of the old choice stays
    assert all(m is before[m.id] for m in second if m.id in before)
    colours = {m.id: m.color for m in second}
    assert colours[kept_ids[1]] == rgba(BUCKET_ODD) and colours[60] == rgba(RECENT)
    assert set(kept.built["arrow"]) <= {(h.index, h.time) for h in later}
    moved = HeldChunk(5, 5.5, 10, 0, Pose("map", (-1.0, -1.0, 0.0)))
    (arrow,) = of(memory_markers([moved], chunks=kept), "chunks")
    assert (arrow.pose.position.x, arrow.pose.position.y) == (-1.0, -1.0)


def test_the_path_runs_through_the_held_poses_oldest_first_one_strip_per_frame():
    held = [posed(0), posed(1), posed(2, frame="odom"), posed(3), HeldChunk(4, 4.5, 10, 0)]
    paths = of(memory_markers(held), "path")
    assert len(paths) == 1  # odom has one pose: no strip
    assert paths[0].type == Marker.LINE_STRIP and paths[0].header.frame_id == "map"
    assert [(p.x, p.y) for p in paths[0].points] == [(0.0, 2.0), (1.0, 2.0), (3.0, 2.0)]


def test_evidence_is_enlarged_and_labelled_with_the_answer_cut_short():
    held = [posed(i) for i in range(4)]
    text = "the red toolbox was on the workbench by the door, next to the blue ladder " * 3
    evidence = answer(text, [1.5, 2.5, 3.5], [held[1].pose, None, held[3].pose])
    array = memory_markers(held, Evidence.of(evidence))
    big, labels = of(array, "evidence"), of(array, "answer")
    assert [m.id for m in big] == [0, 2] and [m.id for m in labels] == [0, 2]  # unknown: none
    assert all(m.scale.x > ARROW[0] and m.color == rgba(EVIDENCE) for m in big)
    assert big[1].pose.position.x == 3.0 and big[1].header.frame_id == "map"
    assert labels[0].text.startswith("1.5s: the red toolbox") and labels[0].text.endswith("…")
    assert len(labels[0].text) == len("1.5s: ") + ANSWER_CHARS
    assert "\n" not in labels[0].text


def test_no_pose_at_all_leaves_only_the_deleteall():
    array = memory_markers([HeldChunk(i, float(i), 10, -1) for i in range(5)])
    assert [m.action for m in array.markers] == [Marker.DELETEALL]


class Published:
    """A stand-in node whose publishers record what they publish."""

    def __init__(self) -> None:
        self.messages: dict[str, list] = {}
        self.warnings: list[str] = []

    def create_publisher(self, _type, topic: str, _qos):
        return SimpleNamespace(publish=self.messages.setdefault(topic, []).append)

    def get_logger(self):
        return SimpleNamespace(warning=lambda text, **_: self.warnings.append(text))


def test_the_answer_stays_until_the_next_one_and_a_cancelled_one_replaces_nothing():
    node = Published()
    markers = MemoryMarkers(node, None)
    held = [posed(i) for i in range(3)]
    markers.chunks(held)
    markers.answered(answer("red", [0.5], [held[0].pose]))
    markers.chunks(held + [posed(3)])  # the next chunk keeps the evidence
    markers.answered(answer("blu", [1.5], [held[1].pose], cancelled=True))
    sent = node.messages["~/memory_markers"]
    assert len(sent) == 3
    assert [m.text for m in of(sent[-1], "answer")] == ["0.5s: red"]
    assert len(of(sent[-1], "chunks")) == 4
    markers.answered(answer("blue", [1.5], [None]))  # the next answer: evidence unknown
    assert not of(node.messages["~/memory_markers"][-1], "answer")


def test_markers_that_fail_after_an_answer_are_logged_not_raised():
    node = Published()
    view = MemoryView(node, 4)
    view.markers.publisher = SimpleNamespace(publish=lambda _msg: 1 / 0)
    view.answered(answer("red", [0.5], [posed(0).pose]))
    assert node.warnings and "ZeroDivisionError" in node.warnings[0]


def test_the_rviz_config_shows_the_markers_and_the_image_of_the_default_node():
    """config/memory.rviz (rviz2 itself is not installable here): YAML naming the node's two
    topics with RViz's display classes, transient local as they are published, every namespace
    the markers use, fixed frame map."""
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" /
                             "memory.rviz").read_text())
    manager = config["Visualization Manager"]
    displays = {d["Class"]: d for d in manager["Displays"]}
    markers = displays["rviz_default_plugins/MarkerArray"]
    image = displays["rviz_default_plugins/Image"]
    assert markers["Topic"]["Value"] == "/deltas_memory/memory_markers"
    assert image["Topic"]["Value"] == "/deltas_memory/memory_image"
    for display in (markers, image):
        assert display["Enabled"] and display["Value"]
        assert display["Topic"]["Durability Policy"] == "Transient Local"
        assert display["Topic"]["Reliability Policy"] == "Reliable"
    everything = memory_markers([posed(0, 0), posed(1, -1)], Evidence.of(
        answer("red", [0.5], [posed(0).pose])))
    assert set(markers["Namespaces"]) == {m.ns for m in everything.markers[1:]}
    assert all(markers["Namespaces"].values())
    assert manager["Global Options"]["Fixed Frame"] == "map"
