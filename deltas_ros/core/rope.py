"""Moving cached tokens to new positions: gap-free 3-D layouts and exact key re-rotation.

Qwen3.5 caches keys after its rotary embedding. Rotary embeddings compose, R(p + d) = R(d) R(p),
so a key cached at position p moves to p + d by one more rotation by d; the raw key is not needed.
With Qwen3.5's interleaved 3-D mrope each rotary frequency reads one position row (T, H or W,
chosen by `mrope_section`), so each frequency pair turns by its own row's shift; the channels past
`partial_rotary_factor * head_dim` carry no position and stay.
"""

from __future__ import annotations

import torch


def compacted_positions(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Gap-free positions for a retained token sequence, and the position after its last token.

    positions: (3, T) int64 T/H/W rows of the retained tokens, in cache order.
    Consecutive tokens with the same T position form a group: one text token, or the kept tokens
    of one vision block (which share T and spread over H/W). A group keeps its internal layout and
    starts where the previous one ends (its start + largest offset on any row + 1), the first at 0:
    the layout a fresh stream of just these tokens gets, and the identity on a stream with no gaps.
    Returns (new positions (3, T), end); every row of a token moves by the same shift.
    """
    if positions.numel() == 0:
        return positions.clone(), 0
    starts = positions[0]
    opens = torch.ones_like(starts, dtype=torch.bool)
    opens[1:] = starts[1:] != starts[:-1]
    group = opens.cumsum(0) - 1  # (T,) group of each token
    extent = torch.zeros(int(group[-1]) + 1, dtype=positions.dtype)
    extent.scatter_reduce_(0, group, positions.max(0).values - starts + 1, "amax")
    new_starts = extent.cumsum(0) - extent
    shift = (new_starts - starts[opens])[group]
    return positions + shift, int(new_starts[-1] + extent[-1])


class RotaryShift:
    """Re-rotates keys cached by a Qwen3.5 attention layer as if computed at shifted positions.

    rows: (rotary_dim,) which position row (0 T, 1 H, 2 W) each rotary channel reads, laid out
    like the model's cos/sin; inv_freq: (rotary_dim // 2,) the model's inverse frequencies.
    `of` reads both from a loaded model.
    Angles are computed in float64 and applied in float32, so the only error beyond the original
    rotation's own float32 rounding is one rounding to the cache dtype (bf16 on CUDA).
    """

    def __init__(self, rows: torch.Tensor, inv_freq: torch.Tensor) -> None:
        self.rows = rows.long().cpu()
        self.inv_freq = torch.cat([inv_freq, inv_freq]).double().cpu()
        self.rotary_dim = self.rows.numel()

    @classmethod
    def of(cls, model: torch.nn.Module) -> RotaryShift:
        """Key re-rotation for a Qwen3.5 `model`'s text rotary embedding."""
        rotary = model.model.language_model.rotary_emb
        half = rotary.inv_freq.numel()
        rows = rotary.recomposition_frequencies(torch.arange(3.0)[:, None].repeat(1, half))
        return cls(rows, rotary.inv_freq)

    def __call__(self, keys: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """keys (B, kv_heads, T, head_dim) rotated at positions p -> the same keys at p + shift.

        shift: (3, T) int64 per-row shift of each token. Returns a new tensor, dtype of keys.
        """
        angle = shift.cpu().double()[self.rows].T * self.inv_freq  # (T, rotary_dim)
        cos = angle.cos().float().to(keys.device)
        sin = angle.sin().float().to(keys.device)
        rotary = keys[..., :self.rotary_dim].float()
        rotated = rotary * cos + rotate_half(rotary) * sin
        return torch.cat([rotated.to(keys.dtype), keys[..., self.rotary_dim:]], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves: Qwen's rotary pairing (channel i
    with i + d/2), pinned against the model's own in test_backend."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
