"""Scene streams and their questions: ground truth that matches the pixels, answers the forms
promise, scoring that accepts what is right and only that."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest

from deltas_ros.training.palette import ALL_COLOURS, ALL_SHAPES, COLOURS, SHAPES
from deltas_ros.training.questions import (
    FORMS,
    QA,
    TEMPLATES,
    answer_for,
    appear_second,
    identities_of,
    is_correct,
    make_question,
    objects_of,
    sample_questions,
)
from deltas_ros.training.scenes import (
    BUSY,
    HOUR,
    SceneOptions,
    SceneStream,
    busy_options,
    scene_stream,
)
from deltas_ros.training.train import scene_tokenizer

OPTIONS = SceneOptions(objects=(3, 3), cuts=(1, 1), distractors=(1, 2))


def test_scene_stream_is_deterministic_and_its_objects_are_unique():
    a = SceneStream(20, 128, 96, 7, OPTIONS)
    b = SceneStream(20, 128, 96, 7, OPTIONS)
    assert a.events() == b.events()
    assert np.array_equal(a.frame(3.5, 7), b.frame(3.5, 7))
    objects = [e for e in a.events() if e["kind"] == "object"]
    assert len(objects) == 3
    assert len({o["shape"] for o in objects}) == len({o["colour"] for o in objects}) == 3
    assert {e["kind"] for e in a.events()} == {"object", "cut", "distractor"}
    spans = sorted((o["time"], o["end"]) for o in objects)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap


def test_an_object_is_on_screen_exactly_while_its_event_says():
    stream = SceneStream(12, 128, 96, 3, SceneOptions(objects=(1, 1), jitter=0.0))
    event = next(e for e in stream.events() if e["kind"] == "object")
    colour = np.array(COLOURS[event["colour"]])

    def coloured(t: float) -> float:
        frame = stream.frame(t).astype(int)
        return float((np.abs(frame - colour).sum(-1) < 40).mean())

    assert coloured((event["time"] + event["end"]) / 2) > 0.05
    assert coloured(max(0.0, event["time"] - 0.3)) < 0.005
    assert coloured(event["end"] + 0.1) < 0.005


def test_scene_stream_renders_any_size_and_rate():
    frames, events = scene_stream(3, 30, 320, 240, 1, OPTIONS)
    items = list(frames)
    assert len(items) == 90 and items[0][1].shape == (240, 320, 3)
    assert items[1][0] == pytest.approx(1 / 30)
    with pytest.raises(ValueError):
        SceneOptions(objects=(0, 4))


def test_answers_follow_the_forms():
    events = [
        {"kind": "object", "time": 2.2, "end": 4, "shape": "circle", "colour": "red"},
        {"kind": "cut", "time": 5, "end": 5},
        {"kind": "object", "time": 9.0, "end": 11, "shape": "square", "colour": "blue"},
    ]
    assert answer_for("appeared", events) == "a red circle and a blue square"
    assert answer_for("count", events) == "two"
    assert answer_for("colour", events, shape="square") == "the square was blue"
    assert answer_for("shape", events, colour="red") == "a red circle"
    assert answer_for("seen", events, "red", "circle") == "the circle was red: yes"
    assert answer_for("seen", events, "blue", "circle") == "the circle was red: no"
    assert answer_for("seen", events, "red", "triangle") == "the triangle was not seen: no"
    # The first sampled frame showing it is at 2.5 s: in the chunk whose time text says 2.
    assert answer_for("when", events, "red", "circle") == "the red circle appeared at 2 seconds"
    assert appear_second({"time": 9.0}) == 9
    with pytest.raises(ValueError):
        answer_for("colour", events, shape="triangle")
    rng = np.random.default_rng(0)
    for qa in sample_questions(events, rng, 60, {f: 1 for f in FORMS}):
        assert qa.question in {TEMPLATES[qa.form].format(colour=c, shape=s)
                               for c in COLOURS for s in SHAPES}
    seen = [make_question("seen", events, rng).answer.split()[-1] for _ in range(200)]
    assert 50 < seen.count("no") < 150  # negatives are asked too


def test_scoring_accepts_right_answers_only():
    appeared = QA("appeared", "What appeared?", "a red circle and a blue square")
    assert is_correct(appeared, "a blue square and a red circle.")
    assert not is_correct(appeared, "a red circle")
    assert not is_correct(appeared, "a red square and a blue circle")
    when = QA("when", "When did the red circle appear?", "the red circle appeared at 12 seconds")
    assert is_correct(when, "the red circle appeared at 13 seconds") and is_correct(when, "12")
    assert not is_correct(when, "the red circle appeared at 14 seconds")
    assert not is_correct(when, "the blue circle appeared at 12 seconds")
    colour = QA("colour", "What color was the circle?", "the circle was red")
    assert is_correct(colour, "The circle was Red.") and is_correct(colour, "red")
    assert not is_correct(colour, "the circle was red blue")
    assert not is_correct(colour, "the square was red")  # the fact about another object
    seen = QA("seen", "Did you see a blue circle?", "the circle was red: no")
    assert is_correct(seen, "the circle was red: no") and is_correct(seen, "no")
    assert not is_correct(seen, "the circle was red: yes") and not is_correct(seen, "red")
    shape = QA("shape", "Which shape was red?", "a red circle")
    assert is_correct(shape, "a red circle") and not is_correct(shape, "a red square")
    assert not is_correct(shape, "a blue circle")


def test_domain_words_are_single_tokens():
    tokenizer = scene_tokenizer()
    for word in ("red", "circle", "yes", "seconds", "What"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1
    time_text = tokenizer.encode("<12.2 seconds>", add_special_tokens=False)
    assert len(time_text) == 6
    assert tokenizer.decode(time_text) == "<12.2 seconds>"
    assert tokenizer.decode(tokenizer.encode("a red circle", add_special_tokens=False)) \
        == "a red circle"


def _fingerprint(seed: int, options: SceneOptions, seconds: int = 20) -> str:
    stream = SceneStream(seconds, 128, 96, seed, options)
    digest = hashlib.sha256(json.dumps(stream.events(), sort_keys=True).encode())
    for k in range(0, 2 * seconds, 3):
        digest.update(stream.frame(k / 2, k).tobytes())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("options, expected", [
    (SceneOptions(), ["93ce1bc3856df363", "e4225ef5e1d72f69", "c3bed14709210732"]),
    (SceneOptions(objects=(3, 3), cuts=(1, 1), distractors=(1, 2), overlap=True),
     ["1aae521944a87235", "64338803b5c0ee6b", "b05b7c2b65fbe42f"]),
])
def test_todays_scene_streams_are_unchanged(options, expected):
    """The shipped model was trained and evaluated on these: the busy world must not move a
    pixel or an event of them (digests taken before it existed)."""
    assert [_fingerprint(seed, options) for seed in (0, 1, 1_000_123)] == expected


def test_todays_busy_streams_are_unchanged():
    """The busy world's figures were measured on these: the hour world must not move them
    (digests taken before it existed), up to the 10 minutes where busy_options keeps BUSY."""
    assert [_fingerprint(seed, BUSY, 600) for seed in (0, 1, 1_000_123)] == \
        ["64e68586d82a84f4", "fb83cd3e09d60909", "eb6e7e08c2116af9"]
    assert [_fingerprint(seed, replace(BUSY, objects=(8, 8)), 120) for seed in (0, 1)] == \
        ["5f211c61113eeeac", "8391e5b8ae21d6ea"]
    assert busy_options(600) is BUSY and busy_options(3600) is HOUR


def test_busy_streams_share_shapes_and_colours_and_come_back():
    """Over many seeds: all 24 identities occur, 1-12 objects a stream, shapes and colours
    shared within a stream, objects back in view later (after a gap), quiet stretches; an
    identity is one object of its stream, and the same seed gives the same stream."""
    identities, counts, shared_shape, shared_colour, back, quiet = set(), set(), 0, 0, 0, 0.0
    for seed in range(40):
        stream = SceneStream(120, 64, 48, seed, BUSY)
        events = stream.events()
        objects = identities_of(events)
        pairs = [(o["colour"], o["shape"]) for o in objects]
        assert len(set(pairs)) == len(pairs)
        identities |= set(pairs)
        counts.add(len(objects))
        shared_shape += len({s for _, s in pairs}) < len(pairs)
        shared_colour += len({c for c, _ in pairs}) < len(pairs)
        visits = objects_of(events)
        back += len(visits) > len(objects)
        spans = sorted((v["time"], v["end"]) for v in visits)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        quiet = max(quiet, *(b - a for (_, a), (b, _) in zip(spans, spans[1:])), 0.0)
        assert stream.events() == SceneStream(120, 64, 48, seed, BUSY).events()
    assert len(identities) == len(COLOURS) * len(SHAPES) == 24
    assert min(counts) >= 1 and max(counts) == 12 and len(counts) >= 8
    assert shared_shape >= 20 and shared_colour >= 10 and back >= 20
    assert quiet > 30  # seconds without an object
    a, b = SceneStream(30, 64, 48, 3, BUSY), SceneStream(30, 64, 48, 3, BUSY)
    assert np.array_equal(a.frame(7.5, 15), b.frame(7.5, 15))
    with pytest.raises(ValueError):
        SceneOptions(objects=(1, 4))  # four objects need shared shapes
    assert replace(BUSY, objects=(24, 24)).objects == (24, 24)


def test_busy_answers_name_every_object_of_the_shape_oldest_first():
    def obj(time, colour, shape):
        return {"kind": "object", "time": time, "end": time + 2, "shape": shape,
                "colour": colour}

    events = [obj(2.2, "red", "circle"), obj(9.0, "blue", "circle"), obj(20, "red", "square"),
              obj(30, "green", "circle"), obj(40, "red", "circle")]  # the red circle again
    assert answer_for("colour", events, shape="circle") == "the circle was red, blue and green"
    assert answer_for("colour", events, shape="square") == "the square was red"
    assert answer_for("shape", events, colour="red") == "a red circle and a red square"
    assert answer_for("seen", events, "blue", "circle") == \
        "the circle was red, blue and green: yes"
    assert answer_for("seen", events, "white", "circle") == \
        "the circle was red, blue and green: no"
    assert answer_for("seen", events, "red", "triangle") == "the triangle was not seen: no"
    assert answer_for("when", events, "red", "circle") == \
        "the red circle appeared at 2 seconds"  # its first appearance
    assert answer_for("appeared", events) == \
        "a red circle, a blue circle, a red square and a green circle"
    assert answer_for("count", events) == "four"
    colour = QA("colour", "What color was the circle?", "the circle was red, blue and green")
    assert is_correct(colour, "the circle was red, blue and green")
    assert not is_correct(colour, "the circle was blue, red and green")  # oldest first
    assert not is_correct(colour, "the circle was red and blue")
    shape = QA("shape", "Which shape was red?", "a red circle and a red square")
    assert is_correct(shape, "a red circle and a red square")
    assert not is_correct(shape, "a red circle")
    rng = np.random.default_rng(1)
    for _ in range(50):  # the questions keep their wording; every one has an answer
        qa = make_question(str(rng.choice(FORMS)), events, rng)
        assert qa.question in {TEMPLATES[qa.form].format(colour=c, shape=s)
                               for c in COLOURS for s in SHAPES}


def _parts(events: list[dict], part_s: float) -> list[list[dict]]:
    """The object events of each part, by appearance time."""
    visits = objects_of(events)
    count = int(np.ceil(max(v["end"] for v in visits) / part_s))
    return [[v for v in visits if k * part_s <= v["time"] < (k + 1) * part_s]
            for k in range(count)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_hour_holds_things_seen_only_in_each_part(seed):
    """The hour world: every 5-minute part has 20 appearances (the busy world's 8 every 2
    minutes), objects seen only in it, revisits, and a quiet stretch of 30 s or more; identities
    drawn from 12 colours x 5 shapes, one per part's object of its own; every shown object has
    a never-shown pair of its shape and one of its colour (the controls of "seen")."""
    stream = SceneStream(3600, 64, 48, seed, HOUR)
    events = stream.events()
    parts = _parts(events, HOUR.part_s)
    assert len(parts) == 12
    seen_in = {}
    for k, part in enumerate(parts):
        assert len(part) == 20
        for v in part:
            seen_in.setdefault((v["colour"], v["shape"]), set()).add(k)
        spans = [(0.0, 0.0), *[(v["time"], v["end"]) for v in part],
                 ((k + 1) * HOUR.part_s, 0.0)]
        spans[0] = (k * HOUR.part_s,) * 2
        assert max(b[0] - a[1] for a, b in zip(spans, spans[1:])) >= 30  # quiet
        assert all(a[1] <= b[0] for a, b in zip(spans[1:-1], spans[2:-1]))  # one at a time
    only = [next(iter(p)) for p in seen_in.values() if len(p) == 1]
    assert set(only) == set(range(12))  # things seen only in each part
    assert len([p for p in seen_in.values() if len(p) > 1]) >= 5  # revisits across parts
    visits = objects_of(events)
    assert len(visits) > len(seen_in) >= 24  # revisits; at least two objects of its own a part
    shown = set(seen_in)
    assert {c for c, _ in shown} <= set(ALL_COLOURS) and {s for _, s in shown} <= set(ALL_SHAPES)
    never = {(c, s) for c in ALL_COLOURS for s in ALL_SHAPES} - shown
    for colour, shape in shown:
        assert any(s == shape for _, s in never) and any(c == colour for c, _ in never)
    assert SceneStream(3600, 64, 48, seed, HOUR).events() == events
    assert np.array_equal(stream.frame(1234.5, 2469), SceneStream(
        3600, 64, 48, seed, HOUR).frame(1234.5, 2469))


def test_an_hours_questions_have_controls_and_one_answer():
    """"seen" about an hour asks about shown objects and about never-shown pairs of the 60,
    mostly sharing the shape or colour of a shown one; "when" names one first appearance."""
    events = SceneStream(1800, 64, 48, 5, HOUR).events()
    shown = {(o["colour"], o["shape"]) for o in identities_of(events)}
    rng = np.random.default_rng(0)
    yes = no = near = 0
    for _ in range(300):
        qa = make_question("seen", events, rng, extended=True)
        colour, shape = qa.question[len("Did you see a "):-1].split()
        assert (colour, shape) in shown or qa.answer.endswith(": no")
        if (colour, shape) in shown:
            yes += qa.answer.endswith(": yes")
        else:
            no += 1
            near += any(c == colour or s == shape for c, s in shown)
    assert yes > 100 and no > 100 and near > 0.6 * no
    for o in identities_of(events):
        qa = make_question("when", events, rng, about=o)
        second = appear_second(o)
        assert qa.answer == f"the {o['colour']} {o['shape']} appeared at {second} seconds"
        assert is_correct(qa, qa.answer)


def test_the_hour_worlds_new_shapes_and_colours_are_drawn():
    """A lime cross and a teal diamond cover their colour where their event says."""
    options = replace(HOUR, objects=(4, 4), jitter=0.0, part_s=0.0, shared=True, reappear=0.0)
    for seed in range(40):
        stream = SceneStream(12, 128, 96, seed, options)
        found = [e for e in stream.events() if e["kind"] == "object"
                 and e["colour"] in ("lime", "teal") and e["shape"] in ("cross", "diamond")]
        if found:
            break
    event = found[0]
    frame = stream.frame((event["time"] + event["end"]) / 2).astype(int)
    colour = np.array(ALL_COLOURS[event["colour"]])
    assert (np.abs(frame - colour).sum(-1) < 40).mean() > 0.03
    assert make_question("seen", stream.events(), np.random.default_rng(0),
                         about=event, extended=True).question == \
        f"Did you see a {event['colour']} {event['shape']}?"
