"""Per-token retention signals beside DeltaS: those that read the state, and the published
baselines.

Each is a score under the one shared selection (policy.select_keep): only the score differs.

- write strength (beta*||e||): what the gated delta rule writes for each token, replayed token
  by token with decay: beta_t * ||v_t - alpha_t S_{t-1} k_t||.
- state surprise: what the gated delta rule would write for token t against the state as it was
  before the chunk, beta_t * ||v_t - S_before k_t||, relative to ||v_t|| and averaged over the
  linear-attention layers (Eq. 3's layer average, at token level). One batched matmul per layer
  on the chunk's keys; S_before is the state the chunked kernel is handed (the DeltaS snapshot).
- temporal redundancy (InfiniPot-V's TaR): how unlike its key is to the key at the same place in
  the previous chunk (the most recent frame when the chunk arrived), times the value norm (VaN).
- proxy saliency (StreamMem): the attention the chat template's generic assistant-turn tokens
  put on each cached slot, over the full-attention layers (asking.proxy_saliency).
- pixel difference: the chunk's mean absolute pixel change from the previous chunk's frames.

The slow versions are in signals_reference.py; test_signals compares them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# Low mantissa bits of a float32 score that `lexicographic` gives to the within-chunk rank.
RANK_BITS = 8


def write_strength(key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None, normalize_keys: bool = True
                   ) -> torch.Tensor:
    """beta_t * ||v_t - alpha_t S_{t-1} k_t|| per token: the baseline signal beta*||e||.

    Replays the gated delta rule token by token (the residual is not a by-product of the chunked
    kernel, which is why this signal costs ~100x more than state drift).
    key: (B, n, Hk, dk), value: (B, n, Hv, dv), g (log alpha), beta: (B, n, Hv),
    initial_state: (B, Hv, dk, dv) or None. Returns (B, n), averaged over value heads.
    """
    key = _kernel_keys(key, value.shape[2], normalize_keys)
    value, g, beta = value.float(), g.float(), beta.float()
    batch, length, heads, dk = key.shape
    state = (torch.zeros(batch, heads, dk, value.shape[-1], device=value.device)
             if initial_state is None else initial_state.float().clone())
    strength = torch.empty(batch, length, device=value.device)
    for t in range(length):
        k_t, v_t = key[:, t], value[:, t]  # (B, H, dk), (B, H, dv)
        state = state * g[:, t].exp()[..., None, None]
        residual = v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)
        written = beta[:, t, :, None] * residual
        state = state + k_t[..., :, None] * written[..., None, :]
        strength[:, t] = written.norm(dim=-1).mean(-1)
    return strength


def state_surprise(key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None, normalize_keys: bool = True
                   ) -> torch.Tensor:
    """beta_t * ||v_t - S_before k_t|| / ||v_t|| per token, norms over all value heads.

    key: (B, n, Hk, dk), value: (B, n, Hv, dv), beta: (B, n, Hv), initial_state (S_before):
    (B, Hv, dk, dv) or None (zeros). Returns (B, n) float32. g (the decay) is unused: every token
    is measured against the state before the chunk, not the one its predecessors left.

    Dividing by ||v_t|| makes the signal scale-free: layers whose values differ in scale weigh
    alike in the layer mean, and chunks stay comparable (a per-chunk normalisation would erase
    the difference between chunks that the selection ranks). The ratio is 0 for a zero value.
    """
    del g
    value = value.float()
    residual = value
    if initial_state is not None:
        k = _kernel_keys(key, value.shape[2], normalize_keys).transpose(1, 2)  # (B, Hv, n, dk)
        retrieved = torch.matmul(k, initial_state.float()).transpose(1, 2)  # (B, n, Hv, dv)
        residual = value - retrieved
    written = (beta.float()[..., None] * residual).flatten(2)
    scale = value.flatten(2).norm(dim=-1)
    ratio = written.norm(dim=-1) / scale.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(scale > 0, ratio, torch.zeros_like(ratio))


def _kernel_keys(key: torch.Tensor, heads: int, normalize: bool) -> torch.Tensor:
    """Keys (B, n, Hk, dk) as the chunked kernel reads them: float32, l2-normalised when it
    normalises, repeated to the `heads` value heads: (B, n, heads, dk)."""
    key = key.float().repeat_interleave(heads // key.shape[2], dim=2)
    if normalize:
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    return key


def layer_mean(per_layer: Sequence[torch.Tensor]) -> torch.Tensor:
    """Recorded (B, n) per linear-attention layer -> (n,) host mean over layers (batch 0)."""
    return torch.stack([t[0] for t in per_layer]).mean(0).cpu()


def lexicographic(primary: float, secondary: torch.Tensor) -> torch.Tensor:
    """(n,) float32 scores that order as (primary, then secondary) under one float comparison.

    primary: a chunk's score >= 0 (its drift; NaN or inf is passed through to every token);
    secondary: (n,) per-token scores. The low
    RANK_BITS mantissa bits of float32(primary) are replaced by each token's rank within the
    chunk by `secondary` (scaled to those bits): non-negative floats order like their bit
    patterns, so a bucket fills whole chunks by primary and a chunk that only partly fits keeps
    its best tokens by secondary. Chunks whose primaries agree to 2^-15 relative tie on primary.
    """
    n = secondary.numel()
    if not (math.isfinite(primary) and primary >= 0):  # a broken state: no order to give
        return torch.full((n,), primary)
    rank = torch.empty(n, dtype=torch.int64)
    rank[torch.argsort(secondary.float().cpu(), stable=True)] = torch.arange(n)
    code = rank * (1 << RANK_BITS) // max(n, 1)
    base = torch.tensor(primary + 0.0, dtype=torch.float32).view(torch.int32).item()  # no -0
    base &= ~((1 << RANK_BITS) - 1)
    return (code.to(torch.int32) + base).view(torch.float32)


def temporal_redundancy(keys: Sequence[torch.Tensor],
                        previous: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """(n,) cosine similarity of each token's key to the previous chunk's key at the same place,
    averaged over full-attention layers and KV heads.

    keys, previous: one (B, kv_heads, n, head_dim) / (B, kv_heads, m, head_dim) per layer. A
    chunk's video tokens close it (then the vision end), so places are counted from the end;
    tokens without a counterpart (a longer timestamp, the first chunk) get similarity 0.
    """
    n = keys[0].shape[2]
    if previous is None:
        return torch.zeros(n)
    m = min(n, previous[0].shape[2])
    sims = torch.stack([
        torch.nn.functional.cosine_similarity(k[0, :, n - m:].float(), p[0, :, -m:].float(),
                                              dim=-1).mean(0)
        for k, p in zip(keys, previous)]).mean(0)
    return torch.cat([torch.zeros(n - m, device=sims.device), sims]).cpu()


def pixel_difference(frames: Sequence[np.ndarray], previous: Sequence[np.ndarray] | None
                     ) -> float:
    """Mean |frame - previous frame| in [0, 1] over the chunk's frames, paired in order.

    frames: the chunk's (H, W, 3) uint8 frames. No previous chunk, or frames of another size:
    1.0 (everything is new, as the first chunk's drift)."""
    if previous is None or len(previous) != len(frames) or any(
            a.shape != b.shape for a, b in zip(frames, previous)):
        return 1.0
    # |a - b| as max - min stays in uint8: no widened copy of the frames.
    return float(np.mean([(np.maximum(a, b) - np.minimum(a, b)).mean() for a, b in
                          zip(frames, previous)]) / 255.0)
