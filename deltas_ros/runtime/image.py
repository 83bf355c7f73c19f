"""A picture of what the memory holds: a timeline strip of small thumbnails of retained chunks.

    strip = MemoryImage(max_thumbnails=24)
    strip.add(result.index, result.time, result.drift, frames[-1])   # after each chunk
    strip.retain(memory.slots.retained_chunks())                     # after an eviction
    rgb = strip.render()                                             # (H, W, 3) uint8

Each tile is one chunk's last frame shrunk to THUMB_W x THUMB_H, labelled with its stream time
and drift, over a bar whose length is the drift relative to the largest shown: the chunks DeltaS
kept stand out as the tall bars between the recent window's. The thumbnails live here, outside
the model's memory, at most `max_thumbnails` of them (about 9 KB each): when more chunks are held
the strip is thinned where it is densest in time, so it keeps spanning the whole memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

THUMB_W, THUMB_H = 64, 48
LABEL_H = 30  # two text lines and the drift bar under each tile
GAP = 2  # pixels between tiles
BACKGROUND = (24, 24, 24)
TEXT = (230, 230, 230)
BAR = (80, 200, 120)


@dataclass(frozen=True)
class Thumbnail:
    chunk: int
    time: float
    drift: float
    pixels: np.ndarray  # (THUMB_H, THUMB_W, 3) uint8 RGB


class MemoryImage:
    """Thumbnails of the held chunks, oldest first, bounded in number (not thread-safe)."""

    def __init__(self, max_thumbnails: int = 24) -> None:
        if max_thumbnails < 2:
            raise ValueError("a memory image needs room for at least 2 thumbnails")
        self.max_thumbnails = max_thumbnails
        self.thumbnails: list[Thumbnail] = []

    def add(self, chunk: int, time_s: float, drift: float, frame: np.ndarray) -> None:
        """Keep a thumbnail of `frame` (H, W, 3) uint8 RGB for chunk `chunk`."""
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"a thumbnail needs an (H, W, 3) uint8 frame, not {frame.shape} "
                             f"{frame.dtype}")
        small = cv2.resize(frame, (THUMB_W, THUMB_H), interpolation=cv2.INTER_AREA)
        self.thumbnails.append(Thumbnail(chunk, float(time_s), float(drift), small))
        if len(self.thumbnails) > self.max_thumbnails:
            del self.thumbnails[self._densest()]

    def retain(self, held: Iterable[int]) -> None:
        """Forget the thumbnails of chunks the memory no longer holds."""
        keep = set(held)
        self.thumbnails = [t for t in self.thumbnails if t.chunk in keep]

    def _densest(self) -> int:
        """The inner thumbnail whose neighbours are closest in time (never the first or last):
        dropping it keeps the strip spread over the memory's whole span."""
        times = [t.time for t in self.thumbnails]
        return min(range(1, len(times) - 1), key=lambda i: (times[i + 1] - times[i - 1], i))

    def render(self) -> np.ndarray:
        """The strip (THUMB_H + LABEL_H, n * (THUMB_W + GAP) + GAP, 3) uint8 RGB; one blank
        tile saying so when nothing is held."""
        tiles = max(1, len(self.thumbnails))
        image = np.full((THUMB_H + LABEL_H, tiles * (THUMB_W + GAP) + GAP, 3), BACKGROUND,
                        np.uint8)
        if not self.thumbnails:
            _text(image, "empty", GAP + 4, THUMB_H // 2)
            return image
        top = max(max(t.drift for t in self.thumbnails), 1e-12)
        for i, thumb in enumerate(self.thumbnails):
            x = GAP + i * (THUMB_W + GAP)
            image[:THUMB_H, x:x + THUMB_W] = thumb.pixels
            _text(image, f"{thumb.time:.1f}s", x + 1, THUMB_H + 10)
            _text(image, f"d{thumb.drift:.3g}", x + 1, THUMB_H + 21)
            width = int(round((THUMB_W - 2) * min(max(thumb.drift / top, 0.0), 1.0)))
            image[THUMB_H + 25:THUMB_H + 29, x + 1:x + 1 + width] = BAR
        return image


def _text(image: np.ndarray, text: str, x: int, y: int) -> None:
    cv2.putText(image, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, 0.3, TEXT, 1, cv2.LINE_AA)
