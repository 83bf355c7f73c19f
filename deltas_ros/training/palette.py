"""What the generated streams are drawn with: named colours, shapes, background tints and noise.

Names matter: they are the words of the events' labels and of the scene model's answers.
"""

from __future__ import annotations

import cv2
import numpy as np

# Saturated colours that stand out from the muted backgrounds, by name for the event labels.
COLOURS = {
    "red": (230, 30, 30), "green": (30, 210, 50), "blue": (40, 70, 240),
    "yellow": (245, 225, 30), "magenta": (230, 40, 220), "cyan": (30, 225, 235),
    "white": (250, 250, 250), "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
# The hour world's further identities (scenes.HOUR): an hour at the busy world's density shows
# far more objects than the 24 pairs above, and every shown one needs never-shown pairs of its
# shape and of its colour. Each colour is at least 85 apart in RGB from every other colour and
# none is grey or dark, so the muted, tinted backgrounds never match one.
MORE_COLOURS = {
    "purple": (140, 60, 230),
    "pink": (255, 150, 190),
    "lime": (170, 250, 70),
    "teal": (0, 150, 140),
}
MORE_SHAPES = ("diamond", "cross")
ALL_COLOURS = {**COLOURS, **MORE_COLOURS}
ALL_SHAPES = (*SHAPES, *MORE_SHAPES)
# Background tints, by name for the labels of cuts.
TINTS = {"grey": (1.0, 1.0, 1.0), "warm": (1.15, 0.95, 0.75), "cool": (0.75, 0.95, 1.15),
         "green": (0.8, 1.15, 0.8), "purple": (1.05, 0.8, 1.1)}


def identities(extended: bool = False) -> tuple[dict[str, tuple[int, int, int]], tuple[str, ...]]:
    """(colours, shapes) a stream draws from: today's 8 x 3, or with the hour world's."""
    return (ALL_COLOURS, ALL_SHAPES) if extended else (COLOURS, SHAPES)


NOISE_BANK = 8  # precomputed noise frames, drawn at random per frame: cheap and still "live"
NOISE_AMPLITUDE = 3


def background(rng: np.random.Generator, width: int, height: int, tint: str) -> np.ndarray:
    """A static textured scene: smooth, muted colour blobs plus finer grey texture, tinted."""
    grey = rng.uniform(70, 180, size=(4, 5, 1))
    coarse = (grey + rng.uniform(-20, 20, size=(4, 5, 3))).astype(np.float32)
    base = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
    fine = rng.uniform(-35, 35, size=(max(2, height // 12), max(2, width // 12), 1))
    texture = cv2.resize(fine.astype(np.float32), (width, height), interpolation=cv2.INTER_LINEAR)
    image = (base + texture[..., None]) * np.array(TINTS[tint], dtype=np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)
