"""Tensor work on cached K/V slots, in plain torch: the eviction's moves, gathers, and the
attention mass a question's queries put on each slot (the evidence)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

# Elements of one slice of question-by-slot attention logits (64 MiB in float32).
EVIDENCE_SLICE_ELEMENTS = 1 << 24


def attention_mass_of(queries: torch.Tensor, keys: torch.Tensor, scaling: float, groups: int,
                      slots: int, slice_elements: int = EVIDENCE_SLICE_ELEMENTS) -> torch.Tensor:
    """Causal softmax attention of the last L cache entries' queries, summed over heads and
    queries, on slots 0..slots-1: (slots,) float32.

    queries (1, heads, L, d) of the cache's last L entries; keys (1, kv_heads, S, d), S >= L.
    As eager attention computes it (logits in the model's dtype, softmax in float32, weights
    back in the model's dtype), but L is walked in slices of at most `slice_elements` logits,
    so a long question needs bounded memory. Each key head is read in place by its `groups`
    query heads (one batched product a key head): a decoded token's mass costs no copy of the
    cache, which repeating the keys per query head did (S x heads x d a layer, every token).
    `kv_ops_reference.attention_mass_reference` is the one-shot version.
    """
    heads, length, dim = queries.shape[1:]
    kv_heads, total = keys.shape[1], keys.shape[2]
    grouped = queries.reshape(kv_heads, groups, length, dim)
    keys_t = keys[0].transpose(1, 2)  # (kv_heads, d, S), a view
    rows = max(1, slice_elements // (heads * total))
    mass = torch.zeros(slots, device=queries.device)
    for start in range(0, length, rows):
        part = grouped[:, :, start:start + rows]
        taken = part.shape[2]
        logits = torch.bmm(part.reshape(kv_heads, groups * taken, dim), keys_t) * scaling
        seen = total - length + start + torch.arange(taken, device=queries.device)
        hidden = torch.arange(total, device=queries.device)[None, :] > seen[:, None]
        logits = logits.view(kv_heads, groups, taken, total).masked_fill(hidden, float("-inf"))
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(queries.dtype)
        mass += weights[..., :slots].float().sum((0, 1, 2))
    return mass


def fill_slots(caches: list[torch.Tensor], holes: torch.Tensor, movers: torch.Tensor,
               size: int) -> list[torch.Tensor]:
    """Each (B, kv_heads, T, head_dim) tensor cut to `size` slots with slots `movers` copied
    into slots `holes` (in place: the results are views of the inputs). Every mover is read
    before anything is written."""
    moving = [cache.index_select(-2, movers) for cache in caches]
    return [cache[..., :size, :].index_copy_(-2, holes, rows)
            for cache, rows in zip(caches, moving)]


def move_slots(caches: list[torch.Tensor], moves: Sequence[tuple[int, int, int]], size: int,
               to_device: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Each (B, kv_heads, T, head_dim) tensor cut to `size` slots with `moves` (to, source,
    count) applied in place (the results are views of the inputs): one index_copy_ into the
    holes per tensor, from one slice when the sources are one range (the newest chunk, usually)
    instead of a gathered copy. Sources lie at or above `size` and targets below it, so nothing
    is read after it was written. to_device: a host index tensor onto the caches' device."""
    def index(ranges: list[tuple[int, int]]) -> torch.Tensor:
        return to_device(torch.from_numpy(
            np.concatenate([np.arange(first, first + count) for first, count in ranges])))

    if not moves:  # only slots at or above `size` were evicted
        return [cache.narrow(-2, 0, size) for cache in caches]
    targets = index([(to, count) for to, _, count in moves])
    if any(b[1] != a[1] + a[2] for a, b in zip(moves, moves[1:])):  # scattered sources
        return fill_slots(caches, targets, index([(s, count) for _, s, count in moves]), size)
    first, moved = moves[0][1], sum(count for _, _, count in moves)
    return [cache.narrow(-2, 0, size).index_copy_(-2, targets, cache.narrow(-2, first, moved))
            for cache in caches]


def gather_slots(cache: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """cache[..., keep, :] for a (B, kv_heads, T, head_dim) K or V tensor.

    Through a (B * kv_heads, T, head_dim) view: PyTorch's CPU index_select is faster on it than
    on the 4-D tensor at small sizes (part of the eviction speed-up `bench.engine_overhead`
    shows); test_backend checks it against index_select on the 4-D tensor.
    """
    batch, heads, _, dim = cache.shape
    return cache.reshape(batch * heads, -1, dim).index_select(1, keep).view(batch, heads, -1, dim)
