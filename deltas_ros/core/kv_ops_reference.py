"""Cached K/V work the slow, obvious way: what `kv_ops.attention_mass_of` and
`Backend.move` are tested against (test_backend, test_memory_eviction), as fla keeps naive.py
beside its kernels: all logits at once, every kept slot gathered, one index per moved slot."""

from __future__ import annotations

import torch

from .backend import Backend
from .kv_ops import fill_slots, gather_slots


def attention_mass_reference(queries: torch.Tensor, keys: torch.Tensor, scaling: float,
                             groups: int, slots: int) -> torch.Tensor:
    """`kv_ops.attention_mass_of` in one piece (all L x S logits at once)."""
    length, total = queries.shape[2], keys.shape[2]
    keys = keys.repeat_interleave(groups, dim=1)
    logits = torch.matmul(queries, keys.transpose(2, 3)) * scaling
    causal = torch.ones(length, total, dtype=torch.bool).tril(total - length)
    logits = logits.masked_fill(~causal.to(logits.device), float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(queries.dtype)
    return weights[0, :, :, :slots].float().sum((0, 1))


def gather_cache(backend: Backend, keep: torch.Tensor) -> None:
    """Keep only slots `keep` (sorted indices) in every full-attention layer, every kept slot
    copied in order."""
    keep = keep.to(backend.device)
    backend.replace_kv([gather_slots(cache, keep) for cache in backend.kv_tensors()])


def fill_cache(backend: Backend, holes: torch.Tensor, movers: torch.Tensor, size: int) -> None:
    """`Backend.move` one index per slot: the slots `movers` into `holes`, cut to `size`."""
    backend.replace_kv(fill_slots(backend.kv_tensors(), backend.device_index(holes),
                                  backend.device_index(movers), size))
