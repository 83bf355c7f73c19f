"""The questions the shipped scene model knows, their true answers, and how answers are scored.

The forms are an interface (docs/model.md lists them). Truth comes from a scene stream's events
(scenes.SceneStream). The model writes the answer; code here only makes training targets and
scores what the model wrote.

    What appeared?                       a red circle and a blue square
    What color was the <shape>?          the circle was red
    Which shape was <color>?             a red circle
    Did you see a <color> <shape>?       the circle was red: yes | the circle was blue: no |
                                         the circle was not seen: no
    When did the <color> <shape> appear? the red circle appeared at 12 seconds  (stream time)
    How many objects appeared?           two

An object is a colour-shape identity: one that comes back into view is still one object. Where
several objects share the shape or colour asked about (the busy world, scenes.BUSY), an answer
names every one of them in order of first appearance (oldest first):

    What color was the circle?           the circle was red and blue
    Which shape was red?                 a red circle and a red square
    Did you see a blue circle?           the circle was red and blue: yes
    When did the red circle appear?      its first appearance

An answer names what it is about before the fact asked for: the word the fact is looked up by
is then among the last tokens the model wrote, one attention step from the chunk that shows
it. With bare answers ("red") the model must first carry the question's word to the answer
position and then look up by it; a tiny model trained for an hour never learned that two-step
lookup, only to name the colour of some object in the stream.

An hour's questions (the hour world, scenes.HOUR: 12 colours, 5 shapes, ~40 objects an hour)
are "Did you see a <color> <shape>?" and "When did the <color> <shape> appear?" about objects of
every part of the hour; "seen" asks, half the time, about a never-shown pair, most often one
that shares the shape or the colour of a shown object (the hour world always leaves such pairs).
The forms that name every match ("What color was the circle?", "Which shape was red?", "What
appeared?", "How many objects appeared?") keep working on the streams they work on today (up to
12 objects) and are not asked about an hour: there they would list dozens of objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..core.config import StreamConfig
from .palette import (
    ALL_COLOURS,
    ALL_SHAPES,
    COLOURS,
    MORE_COLOURS,
    MORE_SHAPES,
    SHAPES,
    identities,
)

FORMS = ("colour", "shape", "seen", "appeared", "when", "count")
TARGET_FORMS = ("colour", "shape", "seen")  # the forms the accuracy target is about
TEMPLATES = {
    "appeared": "What appeared?",
    "colour": "What color was the {shape}?",
    "shape": "Which shape was {colour}?",
    "seen": "Did you see a {colour} {shape}?",
    "when": "When did the {colour} {shape} appear?",
    "count": "How many objects appeared?",
}
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve")
# Whole words that become single tokens of the scene model's tokenizer. Fixed: their order is
# the shipped model's vocabulary (so only the numbers up to three are whole tokens).
DOMAIN_WORDS = (*COLOURS, *SHAPES, "yes", "no", "a", "and", "seconds", *NUMBERS[:4], "What",
                "appeared", "color", "was", "the", "Which", "shape", "Did", "you", "see", "When",
                "did", "appear", "How", "many", "objects", "at", "not", "seen")
# The hour world's words, after all of the above in the vocabulary (train.load_init copies a
# model trained without them and gives them rows of their own).
MORE_WORDS = (*MORE_COLOURS, *MORE_SHAPES)
HOUR_FORMS = ("seen", "when")  # the forms asked about an hour
TIME_TEXT_PIECES = (" seconds>",)  # the tail of each chunk's "<t seconds>" time text
WHEN_TOLERANCE_S = 1  # a "when" answer counts within this many whole seconds


@dataclass(frozen=True)
class QA:
    """One question about a stream, with its true answer (what the model should write)."""

    form: str
    question: str
    answer: str


def objects_of(events: list[dict]) -> list[dict]:
    """The object events, in order of appearance (one per time in view)."""
    return sorted((e for e in events if e["kind"] == "object"), key=lambda e: e["time"])


def identities_of(events: list[dict]) -> list[dict]:
    """One event per object (colour-shape identity), its first time in view, oldest first."""
    first: dict[tuple[str, str], dict] = {}
    for event in objects_of(events):
        first.setdefault((event["colour"], event["shape"]), event)
    return list(first.values())


def appear_second(event: dict, fps: float = StreamConfig.fps) -> int:
    """Whole stream second of the first sampled frame showing the object: the integer part of
    the time text of the first chunk it is in (frames are sampled at k / fps)."""
    first = np.ceil(event["time"] * fps - 1e-9) / fps
    return int(first)


def listing(names: list[str]) -> str:
    """ "red", "red and blue", "red, blue and green" """
    if len(names) <= 2:
        return " and ".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def describe(objects: list[dict]) -> str:
    """ "a red circle", "a red circle and a blue square", "a red circle, a ... and a ..." """
    return listing([f"a {o['colour']} {o['shape']}" for o in objects])


def answer_for(form: str, events: list[dict], colour: str = "", shape: str = "") -> str:
    """The true answer to a question of `form` about a stream with these events."""
    objects = identities_of(events)
    if form == "appeared":
        return describe(objects)
    if form == "count":
        return NUMBERS[len(objects)]
    if form == "seen":  # what the shape was, then whether that is the colour asked
        found = [o["colour"] for o in objects if o["shape"] == shape]
        if not found:
            return f"the {shape} was not seen: no"
        return f"the {shape} was {listing(found)}: {'yes' if colour in found else 'no'}"
    match = [o for o in objects if (not shape or o["shape"] == shape)
             and (not colour or o["colour"] == colour)]
    if not match or (form == "when" and len(match) != 1):
        raise ValueError(f"{form!r}: no object of the stream is {colour} {shape}".strip())
    if form == "colour":
        return f"the {shape} was {listing([o['colour'] for o in match])}"
    if form == "shape":
        return describe(match)
    found = match[0]
    if form == "when":
        return f"the {found['colour']} {found['shape']} appeared at {appear_second(found)} seconds"
    raise ValueError(f"unknown question form {form!r}; choose one of {', '.join(FORMS)}")


def make_question(form: str, events: list[dict], rng: np.random.Generator,
                  about: dict | None = None, extended: bool = False) -> QA:
    """A question of `form` about the stream (about `about` when it names an object, else a
    random one); "seen" asks about a seen object or, half the time, an unseen pair that shares
    its shape or its colour (the hard negative) or neither, from the stream's identities
    (palette.identities(extended))."""
    objects = identities_of(events)
    target = about or objects[int(rng.integers(len(objects)))]
    colour, shape = target["colour"], target["shape"]
    if form == "seen" and about is None and rng.random() < 0.5:
        seen = {(o["colour"], o["shape"]) for o in objects}
        colours, shapes = identities(extended)
        unseen = [(c, s) for c in colours for s in shapes if (c, s) not in seen]
        near = [(c, s) for c, s in unseen if c == colour or s == shape]
        pool = near if near and rng.random() < 0.7 else unseen
        colour, shape = pool[int(rng.integers(len(pool)))]
    question = TEMPLATES[form].format(colour=colour, shape=shape)
    keys = {"colour": {"shape": shape}, "shape": {"colour": colour}}.get(
        form, {"colour": colour, "shape": shape})
    return QA(form, question, answer_for(form, events, **keys))


def sample_questions(events: list[dict], rng: np.random.Generator, count: int,
                     weights: dict[str, float], extended: bool = False) -> list[QA]:
    """`count` questions, forms drawn by `weights` (forms missing from it are never asked)."""
    forms = [f for f in FORMS if weights.get(f, 0) > 0]
    p = np.array([weights[f] for f in forms], dtype=float)
    picks = rng.choice(len(forms), size=count, p=p / p.sum())
    return [make_question(forms[i], events, rng, extended=extended) for i in picks]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def is_correct(qa: QA, text: str) -> bool:
    """Whether the model's answer `text` says what `qa.answer` says.

    "appeared": the set of (colour, shape) pairs named; "colour", "shape", "when": the fact
    asked for (the one colour, the one shape, the whole second within WHEN_TOLERANCE_S), with
    nothing named that the truth does not name; "seen": the last yes or no (the verdict);
    "count": word-exact.
    """
    said, truth = _words(text), _words(qa.answer)
    if qa.form == "appeared":
        return _pairs(said) == _pairs(truth)
    said_colours, true_colours = _named(said, ALL_COLOURS), _named(truth, ALL_COLOURS)
    said_shapes, true_shapes = _named(said, ALL_SHAPES), _named(truth, ALL_SHAPES)
    only_truth = set(said_colours) <= set(true_colours) and set(said_shapes) <= set(true_shapes)
    if qa.form == "colour":
        return said_colours == true_colours and only_truth
    if qa.form == "shape":
        return said_shapes == true_shapes and only_truth
    if qa.form == "when":
        numbers, true_second = [w for w in said if w.isdigit()], int(truth[-2])
        return (len(numbers) == 1 and only_truth
                and abs(int(numbers[0]) - true_second) <= WHEN_TOLERANCE_S)
    if qa.form == "seen":
        verdicts = _named(said, ("yes", "no"))
        return bool(verdicts) and verdicts[-1] == truth[-1]
    return said == truth


def _named(words: list[str], names) -> list[str]:
    return [w for w in words if w in names]


def _pairs(words: list[str]) -> set[tuple[str, str]] | None:
    """{(colour, shape)} named as "colour shape" pairs; None if any word is out of place."""
    pairs, colour = set(), None
    for word in words:
        if word in ALL_COLOURS and colour is None:
            colour = word
        elif word in ALL_SHAPES and colour is not None:
            pairs.add((colour, word))
            colour = None
        elif word not in ("a", "and"):
            return None
    return pairs if colour is None else None
