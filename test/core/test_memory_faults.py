"""Failures mid-chunk or mid-answer roll the memory back bit for bit; chunk building is robust."""

import copy

import numpy as np
import pytest
import torch
from engine_helpers import TINY_FRAMES, any_call, assert_same_state, fail_on_call, feed, frozen
from hypothesis import event, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5VisionModel

from deltas_ros.core import memory as memory_module
from deltas_ros.core.chunks import ChunkBuilder
from deltas_ros.core.memory import ChunkFailed, MemoryConfig, QuestionFailed, StreamingMemory

FAULT_CONFIG = dict(budget_tokens=160, window_tokens=40, max_new_tokens=4, **TINY_FRAMES)
LAST_ATTENTION = 7  # the tiny model's second full-attention layer


def last_attention_layer(module, *args, **kwargs) -> bool:
    return module.layer_idx == LAST_ATTENTION


@pytest.mark.parametrize("owner, name, only, policy", [
    (Qwen3_5VisionModel, "forward", any_call, "surprise"),
    (Qwen3_5Attention, "forward", last_attention_layer, "surprise"),  # after 6 linear, 1 attention
    # after the whole prefill and scoring, under a per-chunk and a per-token policy
    (memory_module, "select_keep", any_call, "deltas"),
    (memory_module, "select_keep", any_call, "surprise"),
], ids=["vision", "attention", "eviction", "eviction-per-token"])
def test_failed_chunk_rolls_back_bit_identically(tiny_model, monkeypatch, owner, name, only,
                                                 policy):
    memory = StreamingMemory(tiny_model, MemoryConfig(**FAULT_CONFIG, policy=policy))
    feed(memory, range(8))  # full: the next chunk evicts
    before, twin = frozen(memory), copy.deepcopy(memory)
    calls = fail_on_call(monkeypatch, owner, name, 1, only)
    with pytest.raises(ChunkFailed, match="chunk 8 failed and was rolled back: OutOfMemory") as e:
        feed(memory, range(8, 9))
    assert calls == [1] and isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert_same_state(frozen(memory), before)

    monkeypatch.undo()
    retried, never_failed = feed(memory, range(8, 11)), feed(twin, range(8, 11))
    assert [r.drift for r in retried] == [r.drift for r in never_failed]
    assert retried[0].evicted_tokens > 0
    assert_same_state(frozen(memory), frozen(twin))


def test_failed_answer_leaves_the_memory_bit_identical(tiny_model, monkeypatch):
    memory = StreamingMemory(tiny_model, MemoryConfig(**FAULT_CONFIG))
    feed(memory, range(6))
    before, twin = frozen(memory), copy.deepcopy(memory)
    calls = fail_on_call(monkeypatch, Qwen3_5Attention, "forward", 2, last_attention_layer)
    with pytest.raises(QuestionFailed, match="question failed and was rolled back") as e:
        memory.ask("What is on the table?")
    assert calls == [1, 2]  # the question's prefill, then the first decoding step failed
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert_same_state(frozen(memory), before)

    monkeypatch.undo()
    assert memory.ask("What is on the table?").text == twin.ask("What is on the table?").text
    feed(memory, range(6, 8))
    feed(twin, range(6, 8))
    assert_same_state(frozen(memory), frozen(twin))


MOSTLY = st.sampled_from([True, True, True, True, False])


@st.composite
def chunk_inputs(draw):
    """Frames of any size 1..300 px; counts, sizes and times mostly valid, sometimes not."""
    if draw(MOSTLY):
        count = 2 * draw(st.integers(1, 3))
    else:
        count = draw(st.sampled_from([0, 1, 3, 5]))
    side = st.integers(1, 300)
    if draw(MOSTLY):
        sizes = [(draw(side), draw(side))] * count
    else:  # each frame its own size
        sizes = [(draw(side), draw(side)) for _ in range(count)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    if draw(MOSTLY):
        times = draw(st.lists(st.floats(), min_size=count, max_size=count))
    else:
        times = draw(st.lists(st.floats(0, 1e6), max_size=8))
    return frames, times, draw(st.integers(0, 250_000))


@settings(max_examples=100, deadline=None)
@given(inputs=chunk_inputs(), pixel_budget=st.sampled_from([32 * 32, 64 * 64, 320 * 320]))
def test_chunk_builder_gives_consistent_chunks_or_a_clear_value_error(tiny_model, inputs,
                                                                      pixel_budget):
    frames, times, start = inputs
    builder = ChunkBuilder.for_model(tiny_model.model, tiny_model.tokenizer, pixel_budget)
    try:
        chunk = builder.build(frames, times, start)
    except ValueError as error:
        assert str(error)
        event(f"ValueError: {str(error)[:30]}")
        return
    event("built")
    t, h, w = chunk.grid_thw[0].tolist()
    length = chunk.num_tokens
    assert t == len(frames) // 2 and len(times) == len(frames)
    assert chunk.input_ids.shape == chunk.mm_token_type_ids.shape == (1, length)
    assert chunk.position_ids.shape == (3, 1, length)
    assert chunk.pixel_values.shape == (t * h * w, 3 * 2 * 16 * 16)
    assert (chunk.input_ids == builder.video_token_id).sum() == t * h * w // 4
    assert (chunk.mm_token_type_ids == 2).sum() == t * h * w // 4
    assert chunk.position_ids.min() == start and chunk.position_ids.max() < chunk.next_position
    assert torch.isfinite(chunk.pixel_values).all()
