"""Turning one second of camera frames into model input: pixels, tokens and 3-D positions.

A chunk is what Qwen3-VL's processor makes of one temporal group (two frames at 2 fps):

    "<{t:.1f} seconds>" <|vision_start|> <|video_pad|> x (gh * gw / merge^2) <|vision_end|>

with t the mean stream time of its frames. The pixel values and token ids equal the official
processor's for the same frames (test_chunks.py checks it); positions are the explicit 3-D mrope
ids that `get_rope_index` would give the same tokens inside the whole stream, so a stream can be
fed one chunk at a time at a running position offset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms.v2 import functional as tvF

from .config import DEFAULT_PIXEL_BUDGET


@dataclass
class Chunk:
    """Model input for one chunk, batch size 1.

    input_ids:         (1, L) int64
    mm_token_type_ids: (1, L) int32, 2 on video tokens, 0 elsewhere
    pixel_values:      (groups * gh * gw, 3 * temporal_patch * patch^2) float32
    grid_thw:          (1, 3) int64: (groups, gh, gw) in patches
    position_ids:      (3, 1, L) int64: temporal, height, width rows
    next_position:     position offset of whatever follows this chunk
    time:              stream time of the chunk (seconds since the first frame)
    """

    input_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    position_ids: torch.Tensor
    next_position: int
    time: float

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def smart_resize(
    num_frames: int, height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's resize rule: multiples of `factor`, t*h*w within [min_pixels, max_pixels].

    Aspect ratio is kept up to the rounding to `factor` (32 px: one merged vision token).
    """
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if num_frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif num_frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class ChunkBuilder:
    """Builds `Chunk`s for one model: its tokenizer, vision geometry and normalisation."""

    def __init__(
        self,
        tokenizer,
        video_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        patch_size: int = 16,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        pixel_budget: int = DEFAULT_PIXEL_BUDGET,
        min_pixels: int = 32 * 32,
    ) -> None:
        if pixel_budget < (patch_size * merge_size) ** 2:
            raise ValueError(f"pixel_budget {pixel_budget} is smaller than one vision token")
        self.tokenizer = tokenizer
        self.video_token_id = video_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.temporal_patch_size = temporal_patch_size
        self.pixel_budget = pixel_budget
        self.min_pixels = min_pixels
        # The processor fuses 1/255 rescaling into the normalisation: (x - 255 m) / (255 s).
        self._mean = torch.tensor(image_mean, dtype=torch.float32) * 255.0
        self._std = torch.tensor(image_std, dtype=torch.float32) * 255.0

    @classmethod
    def for_model(cls, model, tokenizer, pixel_budget: int = DEFAULT_PIXEL_BUDGET):
        """A builder matching a loaded Qwen3.5 model's config."""
        config, vision = model.config, model.config.vision_config
        return cls(
            tokenizer,
            video_token_id=config.video_token_id,
            vision_start_token_id=config.vision_start_token_id,
            vision_end_token_id=config.vision_end_token_id,
            patch_size=vision.patch_size,
            merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
            pixel_budget=pixel_budget,
        )

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """Resized (height, width) of a temporal group of frames of this size."""
        factor = self.patch_size * self.merge_size
        return smart_resize(
            self.temporal_patch_size, height, width, factor,
            self.min_pixels, self.pixel_budget * self.temporal_patch_size,
        )

    def tokens_per_group(self, height: int, width: int) -> int:
        """Vision tokens one temporal group of frames of this size becomes."""
        h, w = self.frame_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def pixels(self, frames: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames (each H x W x 3 uint8 RGB, same size) -> (pixel_values, grid_thw)."""
        video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)  # (F, 3, H, W) uint8
        height, width = self.frame_size(video.shape[-2], video.shape[-1])
        video = tvF.resize(
            video, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True
        )
        video = (video.float() - self._mean[:, None, None]) / self._std[:, None, None]
        t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        groups, gh, gw = video.shape[0] // t, height // p, width // p
        patches = video.view(groups, t, 3, gh // m, m, p, gw // m, m, p)
        # Patch order of the Qwen-VL vision tower: merge windows row-major, then the m x m patches
        # inside a window; each patch flattened as (channel, time, row, col).
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        pixel_values = patches.reshape(groups * gh * gw, 3 * t * p * p)
        return pixel_values, torch.tensor([[groups, gh, gw]])

    def build(
        self, frames: Sequence[np.ndarray], times: Sequence[float], start_position: int
    ) -> Chunk:
        """One chunk from `temporal_patch_size * k` frames and their stream times (seconds)."""
        if len(frames) == 0 or len(frames) % self.temporal_patch_size:
            raise ValueError(
                f"a chunk needs a multiple of {self.temporal_patch_size} frames, got {len(frames)}"
            )
        if len(times) != len(frames):
            raise ValueError(f"{len(frames)} frames but {len(times)} times")
        pixel_values, grid_thw = self.pixels(frames)
        groups, gh, gw = grid_thw[0].tolist()
        lh, lw = gh // self.merge_size, gw // self.merge_size
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        position = start_position
        t = self.temporal_patch_size
        for g in range(groups):
            group_time = sum(times[g * t:(g + 1) * t]) / t
            text = self.tokenizer.encode(f"<{group_time:.1f} seconds>", add_special_tokens=False)
            text.append(self.vision_start_token_id)
            ids += text + [self.video_token_id] * (lh * lw) + [self.vision_end_token_id]
            rows.append(torch.arange(position, position + len(text)).expand(3, -1))
            position += len(text)
            grid_h, grid_w = torch.meshgrid(torch.arange(lh), torch.arange(lw), indexing="ij")
            rows.append(torch.stack([
                torch.full((lh * lw,), position), position + grid_h.flatten(),
                position + grid_w.flatten(),
            ]))
            position += max(lh, lw)
            rows.append(torch.full((3, 1), position))  # <|vision_end|>
            position += 1
        input_ids = torch.tensor([ids])
        return Chunk(
            input_ids=input_ids,
            mm_token_type_ids=(input_ids == self.video_token_id).int() * 2,
            pixel_values=pixel_values,
            grid_thw=grid_thw,
            position_ids=torch.cat(rows, dim=1)[:, None, :],
            next_position=position,
            time=sum(times) / len(times),
        )

    def text(self, text: str, start_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain text -> (input_ids (1, L), position_ids (3, 1, L)) at the running offset."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        positions = torch.arange(start_position, start_position + len(ids)).expand(3, 1, -1)
        return torch.tensor([ids]), positions
