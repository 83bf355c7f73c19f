"""The memory image: a bounded timeline strip of the held chunks' thumbnails."""

import numpy as np
import pytest

from deltas_ros.runtime.image import GAP, LABEL_H, THUMB_H, THUMB_W, MemoryImage


def solid(value: int, size=(120, 160)) -> np.ndarray:
    return np.full((*size, 3), value, np.uint8)


def tile(image: np.ndarray, i: int) -> np.ndarray:
    x = GAP + i * (THUMB_W + GAP)
    return image[:THUMB_H, x:x + THUMB_W]


def test_strip_shows_the_held_chunks_in_order_with_labels():
    strip = MemoryImage(max_thumbnails=8)
    for c in range(5):
        strip.add(c, c + 0.25, drift=0.1 * (c + 1), frame=solid(40 * c))
    strip.retain([0, 2, 4])  # an eviction dropped chunks 1 and 3
    image = strip.render()
    assert image.shape == (THUMB_H + LABEL_H, 3 * (THUMB_W + GAP) + GAP, 3)
    assert image.dtype == np.uint8
    assert [int(tile(image, i).mean()) for i in range(3)] == [0, 80, 160]
    labels = image[THUMB_H:]
    assert (labels > 100).any()  # text and drift bars are drawn
    bars = (labels[25:29] == (80, 200, 120)).all(-1).sum(1)
    assert bars.max() > 0


def test_thumbnails_are_bounded_and_span_the_memory():
    strip = MemoryImage(max_thumbnails=6)
    for c in range(100):
        strip.add(c, float(c), drift=1.0, frame=solid(c, (30, 40)))
    chunks = [t.chunk for t in strip.thumbnails]
    assert len(chunks) == 6 and chunks[0] == 0 and chunks[-1] == 99
    gaps = np.diff([t.time for t in strip.thumbnails])
    assert gaps.max() <= 3 * gaps.min()  # thinned evenly, not just the newest kept
    assert strip.render().shape[1] == 6 * (THUMB_W + GAP) + GAP


def test_empty_and_bad_frames():
    strip = MemoryImage()
    assert strip.render().shape == (THUMB_H + LABEL_H, THUMB_W + 2 * GAP, 3)
    with pytest.raises(ValueError, match="uint8"):
        strip.add(0, 0.0, 0.1, np.zeros((10, 10), np.uint8))
    with pytest.raises(ValueError):
        MemoryImage(max_thumbnails=1)
