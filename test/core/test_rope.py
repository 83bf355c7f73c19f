"""Position compaction on endless streams: gap-free layouts and exactly re-rotated keys."""

import copy
from contextlib import contextmanager

import pytest
import torch
from engine_helpers import TINY_FRAMES, feed, frames_for, kv, next_logits
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

from deltas_ros.core import memory as memory_module
from deltas_ros.core.eviction_reference import gather_evict
from deltas_ros.core.memory import PREFIX_CHUNK, MemoryConfig, StreamingMemory
from deltas_ros.core.rope import compacted_positions

COMPACTION_CONFIG = dict(budget_tokens=160, window_tokens=40, max_new_tokens=3, **TINY_FRAMES)


def text(*positions: int) -> torch.Tensor:
    return torch.tensor(positions).expand(3, -1)


def block(start: int, cells: list[tuple[int, int]]) -> torch.Tensor:
    """Vision tokens of one block at `start`: T = start, H/W = start + row/column."""
    return torch.tensor([[start, start + r, start + c] for r, c in cells]).T


def test_compacted_positions_close_gaps_and_keep_vision_layouts():
    full_block = [(r, c) for r in range(2) for c in range(3)]
    positions = torch.cat([text(0, 1, 2), text(10, 11), block(12, full_block), text(15),
                           text(40), block(41, [(1, 0), (1, 1)])], dim=1)
    expected = torch.cat([text(0, 1, 2), text(3, 4), block(5, full_block), text(8),
                          text(9), block(10, [(1, 0), (1, 1)])], dim=1)
    new, end = compacted_positions(positions)
    assert torch.equal(new, expected) and end == 12
    # A stream without gaps is its own compaction.
    assert torch.equal(compacted_positions(expected)[0], expected)


def test_compaction_without_gaps_changes_nothing(tiny_model):
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    feed(memory, range(3))
    keys = kv(memory)
    positions = memory.slots.position
    assert memory.compact_positions() == 0 and memory.stats().compactions == 0
    assert all(torch.equal(a, b) for a, b in zip(keys, kv(memory)))
    assert torch.equal(memory.slots.position, positions)
    assert memory.slots.position.max() + 1 == memory.next_position


def test_compacted_layout_is_a_fresh_stream_of_the_kept_chunks(tiny_model, monkeypatch):
    # A window the lowered budget below can hold (the eviction's choice is replaced).
    memory = StreamingMemory(tiny_model, MemoryConfig(window_tokens=8, **TINY_FRAMES))
    feed(memory, range(6))
    dropped = torch.tensor([1, 2, 4])
    keep = (~torch.isin(memory.slots.chunk, dropped)).nonzero().flatten()
    monkeypatch.setattr(memory_module, "select_keep", lambda *args: keep)
    memory.config.budget_tokens = keep.numel()
    memory.evict_to_budget()
    freed = memory.compact_positions()

    fresh = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    for c in (0, 3, 5):
        fresh.add_chunk(frames_for(c), [c, c + 0.5])
    assert torch.equal(in_arrival_order(memory.slots.position, memory), fresh.slots.position)
    assert memory.next_position == fresh.next_position and freed > 0


@contextmanager
def raw_keys(model, full_layers: list[int]):
    """Keys before rotary embedding, in arrival order, kept aligned with the next memory's slots.

    Each full-attention layer's k_norm output (the key just before RoPE) is appended per forward;
    evictions are mirrored by wrapping `select_keep` (the choice of the eviction and of the
    reference). Yields {layer index: (1, kv_heads, T, d)}.
    """
    raw: dict[int, torch.Tensor] = {}

    def recorder(i: int):
        def record(_module, _inputs, out: torch.Tensor) -> None:
            key = out.transpose(1, 2)  # (1, L, kv_heads, d) -> (1, kv_heads, L, d)
            raw[i] = torch.cat([raw[i], key], dim=-2) if i in raw else key
        return record

    layers = model.model.language_model.layers
    hooks = [layers[i].self_attn.k_norm.register_forward_hook(recorder(i)) for i in full_layers]
    select_keep = memory_module.select_keep

    def mirrored(*args):
        keep = select_keep(*args)
        raw.update({i: k[..., keep, :] for i, k in raw.items()})
        return keep

    memory_module.select_keep = mirrored
    try:
        yield raw
    finally:
        memory_module.select_keep = select_keep
        for hook in hooks:
            hook.remove()


def keys_of(memory: StreamingMemory, layer: int) -> torch.Tensor:
    return memory.backend.export_tensors()[f"layers.{layer}.keys"]


def rope(memory: StreamingMemory, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's own rotary embedding of raw keys (1, kv_heads, T, d) at positions (3, T)."""
    rotary = memory.model.model.language_model.rotary_emb
    cos, sin = rotary(raw, positions[:, None, :])
    return apply_rotary_pos_emb(raw, raw, cos, sin)[1]


def in_arrival_order(tensor: torch.Tensor, memory: StreamingMemory) -> torch.Tensor:
    """A (..., T) slot row or (B, H, T, d) K/V tensor with its slots in arrival order."""
    order = memory.slots.arrival_order()
    return tensor[..., order] if tensor.dim() < 4 else tensor[..., order, :]


@pytest.mark.parametrize("gather", [False, True])
def test_compaction_re_rotates_keys_exactly(tiny_model, gather):
    """Compaction changes exactly one thing: each cached key becomes RoPE(raw key, new position).

    Claim checked: (a) after compaction every full-attention layer's cached keys equal the model's
    own RoPE applied to the raw (pre-rotary) keys at the compacted positions, to float32 rounding;
    (b) a question then gives the same logits as the same memory whose keys were replaced by
    exactly that RoPE(raw key, compacted position) - values, conv and recurrent states untouched.
    So, for the attention layers, the compacted cache is what a fresh prefill of the kept keys at
    the compacted positions would cache. It is not a full re-prefill of the kept content: values
    and the Gated DeltaNet states still carry the context the tokens were first seen in, which
    RoPE's relative form leaves position-free.
    """
    full = [i for i, kind in enumerate(tiny_model.model.config.text_config.layer_types)
            if kind == "full_attention"]
    with torch.inference_mode(), raw_keys(tiny_model.model, full) as raw:
        memory = StreamingMemory(tiny_model, MemoryConfig(**COMPACTION_CONFIG))
        if gather:  # the reference eviction: the slots stay in arrival order
            memory.evict_to_budget = lambda: gather_evict(memory)
        feed(memory, range(12))
    old_positions, old_end = memory.slots.position, memory.next_position
    for i in full:  # the harness itself: cached keys are RoPE(raw, original positions)
        assert torch.equal(in_arrival_order(keys_of(memory, i), memory),
                           rope(memory, raw[i], in_arrival_order(old_positions, memory)))

    freed = memory.compact_positions()
    assert freed > 0 and memory.next_position == old_end - freed
    assert memory.stats().compactions == 1
    assert (memory.slots.position != old_positions).any()
    assert memory.slots.position.max() < memory.next_position
    reference = copy.deepcopy(memory)
    order = memory.slots.arrival_order()
    for i in full:
        expected = rope(memory, raw[i], memory.slots.position[:, order])
        torch.testing.assert_close(keys_of(memory, i)[..., order, :], expected, rtol=1e-5,
                                   atol=1e-5)
        reference.backend.cache.layers[i].keys = torch.empty_like(expected).index_copy_(
            -2, order, expected)
    torch.testing.assert_close(next_logits(memory), next_logits(reference), rtol=1e-5, atol=1e-5)


def test_endless_stream_compacts_instead_of_failing(tiny_model):
    config = MemoryConfig(compact_margin=64, **COMPACTION_CONFIG)
    memory = StreamingMemory(tiny_model, config)
    memory.max_positions = 360
    results = []
    for c in range(50):
        results += feed(memory, range(c, c + 1))
        assert memory.next_position <= memory.max_positions - config.compact_margin
        assert memory.slots.position.max() < memory.next_position
        assert (in_arrival_order(memory.slots.position, memory)[0].diff() >= 0).all()
        assert memory.kv_tokens <= config.budget_tokens
        if c % 12 == 11:
            answer = memory.ask("What is on the table?")
            assert answer.generated_tokens <= 3 and answer.evidence_times
    assert memory.stats().compactions >= 3
    assert sum(r.positions_freed for r in results) > 0
    assert memory.stats().retained_chunks[-1] == 49
    assert (memory.slots.chunk == PREFIX_CHUNK).sum() > 0
