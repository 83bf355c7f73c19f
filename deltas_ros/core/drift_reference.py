"""State drift (Eq. 3) the slow, obvious way: the version `drift.drift_of_views` is tested
against (test_drift), as fla keeps naive.py beside its kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def state_drift_reference(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]
) -> tuple[float, list[float]]:
    """(mean over layers, [ratio per layer]) of one recurrent state per linear-attention layer
    before and after a chunk (any shapes, matching in pairs): Eq. 3 one layer at a time, in
    float32, with the first-chunk rule (a layer whose state before is zero changed by 1.0 if its
    state after is not zero, else 0.0)."""
    if len(before) != len(after) or not before:
        raise ValueError(f"need matching, non-empty state lists, got {len(before)}/{len(after)}")
    per_layer = []
    for b, a in zip(before, after):
        if b.shape != a.shape:
            raise ValueError(f"state shapes differ: {tuple(b.shape)} vs {tuple(a.shape)}")
        b, a = b.float(), a.float()
        change, reference = torch.linalg.vector_norm(a - b), torch.linalg.vector_norm(b)
        fresh = torch.linalg.vector_norm(a) > 0
        per_layer.append((change / reference).item() if reference > 0 else float(fresh))
    return sum(per_layer) / len(per_layer), per_layer
