"""State drift (DeltaS, Eq. 3): how far one chunk moved the Gated DeltaNet recurrent states.

    drift(c) = 1/L * sum_i ||S_after^i - S_before^i||_F / ||S_before^i||_F

over the L linear-attention layers, each norm over the layer's whole state (all heads), in float32.
The gated delta rule writes only the residual between a token's value and what the decayed state
already retrieves for its key, so a chunk that moves the state a lot brought something new.

First chunk: before it the state is all zeros and the ratio is undefined. We define the change of a
layer whose previous state is zero as 1.0 (its whole state is new; equivalently the difference is
normalised by the new state's norm), and 0.0 when both are zero. The first chunk is the oldest
candidate and sits in the first temporal bucket, so its exact score rarely matters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def state_drift(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]
) -> tuple[float, list[float]]:
    """Mean and per-layer normalized state drift.

    before, after: one recurrent state per linear-attention layer, any shape, e.g. Qwen3.5's
    (batch, value_heads, key_dim, value_dim); the pairs must match in shape.
    Returns (mean over layers, [ratio per layer]).

    Copies the states into the layout `stacked_drift` reads (rows zero-padded to the largest
    state: zeros change no norm); the engine's states live in that layout
    (backend._StateBuffers), so it copies nothing. `reference.state_drift_reference` is the
    layer-by-layer version.
    """
    check_states(before, after)
    width = max(b.numel() for b in before)
    work = torch.zeros(3, len(before), width, device=before[0].device)
    for row, a, b in zip(work.unbind(1), after, before):
        row[0, :a.numel()].copy_(a.reshape(-1))
        row[2, :b.numel()].copy_(b.reshape(-1))
    return stacked_drift(work)


def stacked_drift(work: torch.Tensor) -> tuple[float, list[float]]:
    """Eq. 3 for all layers in three ops and one host sync: work (3, L, n) float32 holds the
    states after the chunk in work[0] and before it in work[2]; work[1] is scratch.

    One subtraction into work[1], one norm over the (2, L) rows of the difference and the state
    before, one transfer of the 2L norms; work[0] and work[2] are only read. The first-chunk
    rule needs no third norm: where the state before is zero the difference is the state after,
    so "the state after is non-zero" is "the change is non-zero".
    """
    if work.dim() != 3 or work.shape[0] != 3 or work.dtype != torch.float32:
        raise ValueError(f"need a (3, L, n) float32 work tensor, got {tuple(work.shape)} "
                         f"{work.dtype}")
    return drift_of_views(*drift_views(work))


def drift_views(work: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(after, scratch, before, scratch and before) views of a checked `stacked_drift` work
    tensor: a buffer that lives on makes them once (at tiny sizes making four views per chunk
    is much of the drift's cost) and passes them to drift_of_views for every chunk."""
    return work[0], work[1], work[2], work[1:]


def drift_of_views(after: torch.Tensor, scratch: torch.Tensor, before: torch.Tensor,
                   pair: torch.Tensor) -> tuple[float, list[float]]:
    """`stacked_drift` on the views `drift_views` made."""
    torch.sub(after, before, out=scratch)
    change, reference = torch.linalg.vector_norm(pair, dim=-1).tolist()
    per_layer = [c / r if r > 0 else float(c > 0) for c, r in zip(change, reference)]
    return sum(per_layer) / len(per_layer), per_layer


def check_states(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> None:
    if len(before) != len(after) or not before:
        raise ValueError(f"need matching, non-empty state lists, got {len(before)}/{len(after)}")
    for b, a in zip(before, after):
        if b.shape != a.shape:
            raise ValueError(f"state shapes differ: {tuple(b.shape)} vs {tuple(a.shape)}")


def drift_ratio(change: torch.Tensor, reference: torch.Tensor,
                fresh: torch.Tensor) -> torch.Tensor:
    """change / reference, with the first-chunk rule where the reference is zero."""
    return torch.where(
        reference > 0,
        change / reference.clamp_min(torch.finfo(torch.float32).tiny),
        (fresh > 0).float(),
    )


def write_strength(
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    normalize_keys: bool = True,
) -> torch.Tensor:
    """beta_t * ||v_t - alpha_t S_{t-1} k_t|| per token: the baseline signal beta*||e||.

    Replays the gated delta rule token by token (the residual is not a by-product of the chunked
    kernel, which is why this signal costs ~100x more than state drift).
    key: (B, n, Hk, dk), value: (B, n, Hv, dv), g (log alpha), beta: (B, n, Hv),
    initial_state: (B, Hv, dk, dv) or None. Returns (B, n), averaged over value heads.
    """
    heads = value.shape[2]
    key = key.float().repeat_interleave(heads // key.shape[2], dim=2)
    if normalize_keys:
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    value, g, beta = value.float(), g.float(), beta.float()
    batch, length, _, dk = key.shape
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
