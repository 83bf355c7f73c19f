"""The per-token signals the slow, obvious way: what `signals.state_surprise` and
`signals.temporal_redundancy` are tested against (test_signals), token by token and head by
head, as fla keeps naive.py beside its kernels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def state_surprise_reference(
    key: torch.Tensor, value: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """`signals.state_surprise` token by token and head by head: key (B, n, Hk, dk), value
    (B, n, Hv, dv), beta (B, n, Hv), initial_state (B, Hv, dk, dv) or None; returns (B, n).
    Value head h reads key head h // (Hv / Hk); keys l2-normalised as the kernel does."""
    batch, length, heads, dv = value.shape
    group = heads // key.shape[2]
    out = torch.zeros(batch, length)
    for b in range(batch):
        for t in range(length):
            written, scale = 0.0, 0.0
            for h in range(heads):
                k = key[b, t, h // group].double()
                k = k / torch.sqrt((k * k).sum() + 1e-6)
                v = value[b, t, h].double()
                retrieved = (torch.zeros(dv, dtype=torch.float64) if initial_state is None
                             else initial_state[b, h].double().T @ k)
                written += float(((beta[b, t, h].double() * (v - retrieved)) ** 2).sum())
                scale += float((v * v).sum())
            out[b, t] = math.sqrt(written) / math.sqrt(scale) if scale > 0 else 0.0
    return out


def temporal_redundancy_reference(keys: Sequence[torch.Tensor],
                                  previous: Sequence[torch.Tensor] | None) -> list[float]:
    """`signals.temporal_redundancy` one layer, head and place at a time."""
    n = keys[0].shape[2]
    if previous is None:
        return [0.0] * n
    m = min(n, previous[0].shape[2])
    out = [0.0] * n
    for i in range(n - m, n):
        j = previous[0].shape[2] - (n - i)
        sims = [float(torch.nn.functional.cosine_similarity(k[0, h, i].double(),
                                                            p[0, h, j].double(), dim=0))
                for k, p in zip(keys, previous) for h in range(k.shape[1])]
        out[i] = sum(sims) / len(sims)
    return out
