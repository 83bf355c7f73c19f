"""Scene streams, for training and evaluating a model that answers about what it saw.

Saturated shapes appear, move and leave over a textured, noisy, jittering view, with dull
distractors (never counted as objects) and scene cuts. By default each object's shape and colour
are unique within a stream, so every question about "the circle" or "the red one" has one answer.
The busy world (`BUSY`, opt-in) has up to 12 objects out of the 24 colour-shape identities,
sharing shapes and colours, some coming back into view later; an identity is still one object of
the stream.

The hour world (`HOUR`, opt-in) is the busy world at any length, drawn in parts of `part_s`
seconds (5 minutes) from the 60 identities of 12 colours and 5 shapes (palette.ALL_COLOURS,
ALL_SHAPES). Every part shows objects of its own (one of them never again: a thing seen only in
that part), revisits of its own and of earlier parts' objects, 4 appearances a minute (the busy
world's 8 every 2 minutes) and one quiet stretch of 30-90 s with no object at all. One pair per
colour, covering every shape, is never shown: every shown object has never-shown controls of its
shape and of its colour. `HOUR` streams of any length up to an hour use distinct identities for
every part's own objects (12 parts x 4 = 48 = 60 - 12 controls).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import cv2
import numpy as np

from .palette import NOISE_AMPLITUDE, TINTS, background, identities


@dataclass(frozen=True)
class SceneOptions:
    """What a scene stream may contain (counts are drawn uniformly from the ranges).

    objects:      (min, max) objects; at most len(SHAPES), one of each shape at most, unless
                  shared; in the hour layout, each part's objects of its own
    visible_s:    (min, max) seconds an object stays in view (each time it is in view)
    jitter:       camera shake amplitude as a fraction of the frame width
    cuts:         (min, max) scene cuts (a new background from then on)
    distractors:  (min, max) dull grey blobs drifting through (not objects)
    overlap:      whether objects may be in view at the same time
    shared:       objects may share a shape or a colour (each still a distinct colour-shape pair,
                  up to len(COLOURS) * len(SHAPES) objects)
    reappear:     probability that an object comes back into view once more, later; in the
                  hour layout, that an appearance is a revisit of an earlier part's object
    extended:     identities from palette.ALL_COLOURS x ALL_SHAPES instead of today's 8 x 3
    part_s:       > 0: the hour layout (`SceneStream._hour`), parts of this many seconds, cuts
                  and distractors drawn per part

    shared or reappear draws the stream another way (`SceneStream._busy_objects`); without
    them a seed gives the streams it always gave. So do extended and part_s: without them
    (the default) a seed gives the same stream as before they existed.
    """

    objects: tuple[int, int] = (1, 3)
    visible_s: tuple[float, float] = (2.0, 4.0)
    jitter: float = 0.01
    cuts: tuple[int, int] = (0, 1)
    distractors: tuple[int, int] = (0, 1)
    overlap: bool = False
    shared: bool = False
    reappear: float = 0.0
    extended: bool = False
    part_s: float = 0.0

    def __post_init__(self) -> None:
        colours, shapes = identities(self.extended)
        most = len(colours) * len(shapes) if self.shared else len(shapes)
        if not 1 <= self.objects[0] <= self.objects[1] <= most:
            raise ValueError(f"objects must be within 1..{most}, got {self.objects}")
        if not 0 < self.visible_s[0] <= self.visible_s[1]:
            raise ValueError(f"visible_s must be positive and ordered, got {self.visible_s}")
        if min(*self.cuts, *self.distractors) < 0 or self.jitter < 0:
            raise ValueError("cuts, distractors and jitter must be >= 0")
        if not 0 <= self.reappear <= 1:
            raise ValueError(f"reappear must be a probability, got {self.reappear}")
        if self.part_s < 0 or (self.part_s and self.overlap):
            raise ValueError("part_s must be >= 0, and the hour layout has no overlap")

    @property
    def busy(self) -> bool:
        return self.shared or self.reappear > 0


# The busy world: 1-12 of the 24 colour-shape identities a stream, shapes and colours shared,
# a third of them back in view later, more cuts and distractors. Long streams then have long
# quiet stretches between objects (the free time is split at random points).
BUSY = SceneOptions(objects=(1, 12), cuts=(0, 3), distractors=(0, 6), shared=True,
                    reappear=0.33)
# The hour world: parts of 5 minutes, each with 2-4 objects of its own, a third of the
# appearances revisits of earlier parts, cuts and distractors as dense as the busy world's.
HOUR = SceneOptions(objects=(2, 4), cuts=(0, 3), distractors=(0, 6), shared=True, reappear=0.33,
                    extended=True, part_s=300.0)
HOUR_PER_MINUTE = 4.0  # appearances a minute in the hour layout
HOUR_QUIET_S = (30.0, 90.0)  # each part's quiet stretch (at most half the part)


def busy_options(duration_s: float) -> SceneOptions:
    """The busy world of a stream this long: `BUSY` up to 10 minutes (the lengths its figures
    were measured at), the hour world (`HOUR`) beyond."""
    return HOUR if duration_s > 600 else BUSY


@dataclass(frozen=True)
class _Mover:
    """Something that crosses the view in a straight line while visible (fractions of the
    frame: centre from `start` to `stop`, `size` of the height)."""

    shape: str
    colour: tuple[int, int, int]
    time: float
    end: float
    start: tuple[float, float]
    stop: tuple[float, float]
    size: float

    def centre(self, t: float) -> tuple[float, float]:
        a = (t - self.time) / max(self.end - self.time, 1e-9)
        return (self.start[0] + a * (self.stop[0] - self.start[0]),
                self.start[1] + a * (self.stop[1] - self.start[1]))


class SceneStream:
    """A scene stream rendered on demand at any time and size: `frame(t)` (RGB uint8 HxWx3).

    Deterministic from the seed; the same stream renders at 128x96 for training and 640x480
    for a bag (shapes, motion and jitter are in fractions of the frame).
    """

    def __init__(self, duration_s: float, width: int, height: int, seed: int,
                 options: SceneOptions = SceneOptions()) -> None:
        if duration_s <= 0 or width < 32 or height < 32:
            raise ValueError("a scene stream needs a duration > 0 and a frame >= 32x32")
        rng = np.random.default_rng(seed)
        self.duration_s, self.width, self.height = duration_s, width, height
        self.options = options
        colours, shapes = identities(options.extended)
        windows = [(0.0, duration_s)]  # where cuts and distractors are drawn, in turn
        if options.part_s:
            self.labels, spans, windows = self._hour(rng, duration_s, options)
        else:
            count = int(rng.integers(options.objects[0], options.objects[1] + 1))
            if options.busy:
                self.labels = self._busy_objects(rng, count, options)
            else:
                picked = rng.permutation(shapes)[:count]
                self.labels = [(str(c), str(s)) for s, c in
                               zip(picked, rng.permutation(list(colours))[:count])]
            # One mover per time in view: a reappearing object has a label (and a mover) per
            # visit.
            spans = self._spans(rng, len(self.labels), duration_s, options)
        self.objects = [self._mover(rng, s, colours[c], t0, t1)
                        for (c, s), (t0, t1) in zip(self.labels, spans)]
        self.distractors = []
        for start, length in windows:
            for _ in range(int(rng.integers(options.distractors[0],
                                            options.distractors[1] + 1))):
                t0 = round(start + float(rng.uniform(0, max(length - 1.0, 0.1))), 3)
                grey = int(rng.integers(60, 200))
                shade = tuple(int(np.clip(grey + d, 0, 255)) for d in rng.integers(-15, 16, 3))
                self.distractors.append(replace(
                    self._mover(rng, "blob", shade, t0,
                                round(min(duration_s, t0 + float(rng.uniform(1, 4))), 3)),
                    size=float(rng.uniform(0.12, 0.2))))
        tint = "grey"
        self.backgrounds = [(0.0, tint, int(rng.integers(2**31)))]
        for start, length in windows:
            cuts = int(rng.integers(options.cuts[0], options.cuts[1] + 1))
            for time in sorted(rng.uniform(start + 0.5, start + length, cuts)):
                tint = str(rng.choice([name for name in TINTS if name != tint]))
                self.backgrounds.append((round(float(time), 3), tint, int(rng.integers(2**31))))
        self.jitter_phase = rng.uniform(0, 2 * math.pi, 4)
        self.noise_seed = int(rng.integers(2**31))
        self._cache: dict[int, np.ndarray] = {}

    @staticmethod
    def _busy_objects(rng: np.random.Generator, count: int,
                      options: SceneOptions) -> list[tuple[str, str]]:
        """(colour, shape) per time in view, in order: `count` distinct identities (shapes
        and colours shared), each shown once more with probability `reappear`; the visits are
        shuffled, so a second visit may come right after the first or minutes later."""
        colours, shapes = identities(options.extended)
        pairs = [(c, s) for c in colours for s in shapes]
        picked = [pairs[i] for i in rng.choice(len(pairs), count, replace=False)]
        visits = picked + [o for o in picked if rng.random() < options.reappear]
        return [visits[i] for i in rng.permutation(len(visits))]

    @classmethod
    def _hour(cls, rng: np.random.Generator, duration: float, options: SceneOptions,
              ) -> tuple[list[tuple[str, str]], list[tuple[float, float]],
                         list[tuple[float, float]]]:
        """The hour layout: (colour, shape) and visible span per appearance, sorted by time,
        and the (start, length) of every part.

        One identity per colour (shapes in turn) is a never-shown control. Each part takes its
        own objects from the rest, in a shuffled order; its first is seen in this part only,
        the others may be revisited later. Its appearances beyond one per own object are
        revisits: of an earlier part's object with probability `reappear`, else of its own.
        """
        colours, shapes = identities(options.extended)
        colour_order = [str(c) for c in rng.permutation(list(colours))]
        shape_order = [str(s) for s in rng.permutation(list(shapes))]
        controls = {(colour_order[i % len(colours)], shape_order[i % len(shapes)])
                    for i in range(max(len(colours), len(shapes)))}
        pool = [(c, s) for c in colour_order for s in shape_order if (c, s) not in controls]
        pool = [pool[i] for i in rng.permutation(len(pool))]
        labels, spans, windows, revisitable = [], [], [], []
        start = 0.0
        while start < duration:
            length = min(options.part_s, duration - start)
            count = int(rng.integers(options.objects[0], options.objects[1] + 1))
            own, pool = pool[:count], pool[count:]
            visits = list(own)
            for _ in range(round(length / 60 * HOUR_PER_MINUTE) - len(own)):
                if revisitable and (rng.random() < options.reappear or not own):
                    visits.append(revisitable[int(rng.integers(len(revisitable)))])
                elif own:
                    visits.append(own[int(rng.integers(len(own)))])
            visits = [visits[i] for i in rng.permutation(len(visits))]
            quiet = min(float(rng.uniform(*HOUR_QUIET_S)), length / 2)
            quiet_at = float(rng.uniform(0, length - quiet))
            for t0, t1 in cls._spans(rng, len(visits), length - quiet, options):
                shift = start + (quiet if t1 > quiet_at else 0.0)
                spans.append((round(t0 + shift, 3), round(t1 + shift, 3)))
            labels += visits
            revisitable += own[1:]
            windows.append((start, length))
            start += length
        return labels, spans, windows

    @staticmethod
    def _spans(rng: np.random.Generator, count: int, duration: float,
               options: SceneOptions) -> list[tuple[float, float]]:
        """Visible intervals (rounded to ms) inside the stream, sorted; disjoint unless overlap."""
        lo, hi = options.visible_s
        lengths = [min(float(rng.uniform(lo, hi)), duration * 0.9 / count) for _ in range(count)]
        if options.overlap:
            starts = sorted(float(rng.uniform(0, duration - length)) for length in lengths)
        else:
            # Random gaps: the free time split at count sorted uniform points.
            free = duration - sum(lengths)
            cuts = sorted(rng.uniform(0, free, count))
            starts, used = [], 0.0
            for cut, length in zip(cuts, lengths):
                starts.append(cut + used)
                used += length
        return [(round(float(s), 3), round(float(s + length), 3))
                for s, length in zip(starts, lengths)]

    @staticmethod
    def _mover(rng: np.random.Generator, shape: str, colour: tuple[int, int, int],
               t0: float, t1: float) -> _Mover:
        size = float(rng.uniform(0.4, 0.55))
        margin = size / 2
        start = tuple(float(v) for v in rng.uniform(margin, 1 - margin, 2))
        stop = tuple(float(v) for v in rng.uniform(margin, 1 - margin, 2))
        # x in fractions of the width: a size-h object spans size*h/w of it.
        return _Mover(shape, colour, t0, t1, start, stop, size)

    def events(self) -> list[dict]:
        """Ground truth: objects (appear `time`, leave `end`, `shape`, `colour`; one event per
        time in view, so a reappearing object has several), cuts and distractors, sorted by
        time."""
        events = [{"time": o.time, "end": o.end, "kind": "object", "label": f"{c} {s}",
                   "shape": s, "colour": c} for o, (c, s) in zip(self.objects, self.labels)]
        events += [{"time": t, "end": t, "kind": "cut", "label": f"cut to a {tint} scene"}
                   for t, tint, _ in self.backgrounds[1:]]
        events += [{"time": d.time, "end": d.end, "kind": "distractor", "label": "grey blob"}
                   for d in self.distractors]
        return sorted(events, key=lambda e: e["time"])

    def visible(self, t: float) -> list[tuple[str, str]]:
        """(colour, shape) of the objects in view at time t."""
        return [label for o, label in zip(self.objects, self.labels) if o.time <= t < o.end]

    def _background(self, t: float) -> np.ndarray:
        index = bisect.bisect_right([b[0] for b in self.backgrounds], t) - 1
        if index not in self._cache:
            _, tint, seed = self.backgrounds[index]
            # Drawn 25 % larger than the frame so that the jitter never shows a border.
            self._cache[index] = background(np.random.default_rng(seed),
                                             self.width * 5 // 4, self.height * 5 // 4, tint)
        return self._cache[index]

    def frame(self, t: float, index: int = 0) -> np.ndarray:
        """The view at stream time t; `index` picks the sensor noise (a frame counter)."""
        w, h = self.width, self.height
        big = self._background(t)
        amp = self.options.jitter * w
        ph = self.jitter_phase
        dx = amp * (math.sin(2.1 * t + ph[0]) + 0.5 * math.sin(5.3 * t + ph[1]))
        dy = amp * (math.sin(1.7 * t + ph[2]) + 0.5 * math.sin(4.1 * t + ph[3]))
        x0 = int(round((big.shape[1] - w) / 2 + dx))
        y0 = int(round((big.shape[0] - h) / 2 + dy))
        image = np.ascontiguousarray(big[y0:y0 + h, x0:x0 + w])
        for mover in [*self.distractors, *self.objects]:
            if mover.time <= t < mover.end:
                cx, cy = mover.centre(t)
                _draw_shape(image, mover.shape, mover.colour,
                            (cx * w - dx, cy * h - dy), mover.size * h)
        noise = np.random.default_rng((self.noise_seed, index)).integers(
            -NOISE_AMPLITUDE, NOISE_AMPLITUDE + 1, size=image.shape, dtype=np.int16)
        return np.clip(image + noise, 0, 255).astype(np.uint8)

    def frames(self, fps: float) -> Iterator[tuple[float, np.ndarray]]:
        """(time_s, frame) at `fps` from time 0, lazily."""
        for index in range(round(self.duration_s * fps)):
            yield index / fps, self.frame(index / fps, index)


def _draw_shape(image: np.ndarray, shape: str, colour: tuple[int, int, int],
                centre: tuple[float, float], side: float) -> None:
    """Draw a filled shape (outlined, except blobs) of bounding side `side` px, in place."""
    cx, cy, half = int(round(centre[0])), int(round(centre[1])), max(2, int(side / 2))
    outline = max(1, image.shape[1] // 160)
    if shape in ("circle", "blob"):
        axes = (half, half) if shape == "circle" else (half, max(2, half * 2 // 3))
        cv2.ellipse(image, (cx, cy), axes, 0, 0, 360, colour, -1, cv2.LINE_AA)
        if shape == "circle":
            cv2.ellipse(image, (cx, cy), axes, 0, 0, 360, (0, 0, 0), outline, cv2.LINE_AA)
        return
    if shape == "square":
        half = int(half * 0.85)  # about the circle's area
        corners = [(cx - half, cy - half), (cx + half, cy - half), (cx + half, cy + half),
                   (cx - half, cy + half)]
    elif shape == "diamond":
        corners = [(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)]
    elif shape == "cross":  # a plus sign, arms 0.4 of the side wide
        w = max(1, int(half * 0.4))
        corners = [(cx - w, cy - half), (cx + w, cy - half), (cx + w, cy - w), (cx + half, cy - w),
                   (cx + half, cy + w), (cx + w, cy + w), (cx + w, cy + half),
                   (cx - w, cy + half), (cx - w, cy + w), (cx - half, cy + w),
                   (cx - half, cy - w), (cx - w, cy - w)]
    else:
        corners = [(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)]
    points = np.array(corners, dtype=np.int32)
    cv2.fillPoly(image, [points], colour, cv2.LINE_AA)
    cv2.polylines(image, [points], True, (0, 0, 0), outline, cv2.LINE_AA)


def scene_stream(
    duration_s: float, fps: float, width: int, height: int, seed: int = 0,
    options: SceneOptions = SceneOptions(),
) -> tuple[Iterator[tuple[float, np.ndarray]], list[dict]]:
    """Like `synth_stream`: frames (time_s, RGB uint8 HxWx3), lazily, and the events (objects
    with `shape` and `colour`, cuts, distractors). Deterministic from `seed`."""
    if fps <= 0:
        raise ValueError("scene_stream needs fps > 0")
    stream = SceneStream(duration_s, width, height, seed, options)
    return stream.frames(fps), stream.events()
