"""The chunk builder against the official Qwen3-VL processor and get_rope_index."""

import numpy as np
import pytest
import torch
from transformers import AutoProcessor
from transformers.video_utils import VideoMetadata

from deltas_ros.core.chunks import ChunkBuilder, smart_resize
from deltas_ros.core.model_maker import make_processor

SIZES = [(480, 640), (720, 1280), (320, 320), (100, 700), (17, 40)]


def random_frames(count: int, height: int, width: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def processor_chunk(processor, frames, first_index, fps=2.0):
    """What the official processor makes of one chunk's frames (their timestamps included)."""
    return processor(
        text=["<|video_pad|>"], videos=[np.stack(frames)], return_tensors="pt",
        video_metadata=[VideoMetadata(total_num_frames=first_index + len(frames), fps=fps,
                                      frames_indices=list(range(first_index,
                                                                first_index + len(frames))))],
    )


@pytest.fixture(scope="module")
def builder(tiny_model):
    return ChunkBuilder.for_model(tiny_model.model, tiny_model.tokenizer)


@pytest.mark.parametrize("height,width", SIZES)
def test_pixels_and_tokens_equal_the_official_processor(tiny_model_dir, builder, height, width):
    processor = AutoProcessor.from_pretrained(tiny_model_dir, local_files_only=True)
    frames = random_frames(4, height, width)
    position = 0
    for first in (0, 2):  # two consecutive chunks at 2 fps: frames at 0, 0.5 s and 1.0, 1.5 s
        chunk = builder.build(frames[first:first + 2], [first / 2, first / 2 + 0.5], position)
        official = processor_chunk(processor, frames[first:first + 2], first)
        assert torch.equal(chunk.input_ids, official.input_ids)
        assert torch.equal(chunk.mm_token_type_ids, official.mm_token_type_ids.int())
        assert torch.equal(chunk.grid_thw, official.video_grid_thw)
        assert torch.equal(chunk.pixel_values, official.pixel_values_videos)
        position = chunk.next_position


@pytest.mark.parametrize("budget", [64 * 64, 224 * 224, 448 * 448])
def test_pixel_budget_matches_the_processor_sized_to_it(tiny_model, builder, budget):
    processor = make_processor(tiny_model.tokenizer, tiny_model.model.config, budget)
    sized = ChunkBuilder.for_model(tiny_model.model, tiny_model.tokenizer, pixel_budget=budget)
    frames = random_frames(2, 480, 640, seed=1)
    chunk = sized.build(frames, [0.0, 0.5], 0)
    official = processor_chunk(processor, frames, 0)
    assert torch.equal(chunk.input_ids, official.input_ids)
    assert torch.equal(chunk.pixel_values, official.pixel_values_videos)


def test_default_budget_is_about_100_tokens_and_keeps_aspect(builder):
    assert builder.tokens_per_group(320, 320) == 100
    h, w = builder.frame_size(480, 640)
    assert abs(w / h - 640 / 480) < 0.15 and 80 <= builder.tokens_per_group(480, 640) <= 110


def test_positions_equal_get_rope_index_over_the_whole_stream(tiny_model, builder):
    """Chunk by chunk at a running offset == the model's own positions for the whole stream."""
    frames = random_frames(8, 240, 400, seed=2)
    prefix_ids, prefix_pos = builder.text("<|im_start|>user\n", 0)
    ids, positions, types, grids = [prefix_ids], [prefix_pos], [torch.zeros_like(prefix_ids)], []
    offset = prefix_pos.max().item() + 1
    for c in range(4):
        chunk = builder.build(frames[2 * c:2 * c + 2], [c, c + 0.5], offset)
        ids.append(chunk.input_ids)
        positions.append(chunk.position_ids)
        types.append(chunk.mm_token_type_ids)
        grids.append(chunk.grid_thw)
        offset = chunk.next_position
    expected, _ = tiny_model.model.model.get_rope_index(
        torch.cat(ids, 1), mm_token_type_ids=torch.cat(types, 1),
        video_grid_thw=torch.cat(grids),
    )
    assert torch.equal(torch.cat(positions, 2), expected)


def test_a_chunk_of_four_frames_is_two_temporal_groups(builder):
    chunk = builder.build(random_frames(4, 64, 64), [0.0, 0.5, 1.0, 1.5], 0)
    assert chunk.grid_thw.tolist() == [[2, 4, 4]]
    assert (chunk.input_ids == builder.vision_start_token_id).sum() == 2


def test_smart_resize_rules():
    assert smart_resize(2, 320, 320, 32, 1024, 2 * 320 * 320) == (320, 320)
    h, w = smart_resize(2, 1080, 1920, 32, 1024, 2 * 320 * 320)
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 320 * 320
    with pytest.raises(ValueError, match="aspect"):
        smart_resize(2, 32, 32 * 300, 32, 1024, 10**6)


def test_bad_frame_counts_are_refused(builder):
    with pytest.raises(ValueError, match="multiple of 2"):
        builder.build(random_frames(3, 64, 64), [0, 0.5, 1.0], 0)
    with pytest.raises(ValueError, match="times"):
        builder.build(random_frames(2, 64, 64), [0.0], 0)
