"""The chunked gated delta rule for training on a CPU: the same computation as transformers'
`torch_chunk_gated_delta_rule` (the reference; test_gated_delta.py compares outputs, final
states and gradients), with its scan over chunks reading each chunk from `unbind`.

Why: the reference's scan reads chunk i as `x[:, :, i]`, six reads per chunk. The backward of
each read is a zero tensor the size of the whole `x` with one chunk filled, added into the
gradient, so a prefill of n chunks spends O(n^2) on zeros and adds. On a 600 s stream that was
a third of a training step, and more the longer the stream. `unbind` has one backward for all
chunks (a stack), so the backward grows linearly with the stream.

The rule itself (per head, chunk length c, state S (Dk, Dv), within-chunk cumulative log decay
d): the UT system A = tril(beta k k^T * exp(d_i - d_j)) gives the chunk's delta-rule values
u = A^-1 (beta v) and state reads w = A^-1 (beta k exp(d)); then, chunk by chunk,
v' = u - w S, out = (q exp(d)) S + tril(q k^T exp(d_i - d_j)) v',
S <- exp(d_c) S + (k exp(d_c - d))^T v'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last axis (fla's and the reference's normalization)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query, key (B, T, H_k, D_k); value (B, T, H_v, D_v); g (log decay, <= 0) and beta
    (B, T, H_v); initial_state (B, H_v, D_k, D_v) or None -> output (B, T, H_v, D_v) in the
    query's dtype, and the final state (float32) when `output_final_state`. The keyword names
    are the reference's (the model calls it by them)."""
    dtype = query.dtype
    batch, length, k_heads, _ = key.shape
    v_heads, v_dim = value.shape[2:]
    if k_heads != v_heads:  # each query/key head serves consecutive value heads
        query, key = (x.repeat_interleave(v_heads // k_heads, dim=2) for x in (query, key))
    query, key, value, beta, g = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = -length % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunks = (length + pad) // chunk_size

    def split(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, ...) -> (B, H, n, c, ...)
        return x.reshape(batch, v_heads, chunks, chunk_size, *x.shape[3:])

    q, k, v, beta, decay = split(query), split(key), split(value), split(beta), split(g)
    decay = decay.cumsum(-1)  # (B, H, n, c): log decay from the chunk's start
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    within = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * within  # its diagonal is taken as 1
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                          unitriangular=True)
    attention = (q @ k.transpose(-1, -2)) * within
    q_decayed = q * decay.exp()[..., None]
    k_decayed = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1)

    state = (initial_state.float() if initial_state is not None
             else q.new_zeros(batch, v_heads, q.shape[-1], v_dim))
    out = []
    for q_i, k_i, u_i, w_i, a_i, d_i in zip(*(x.unbind(2) for x in (
            q_decayed, k_decayed, values, reads, attention, chunk_decay))):
        corrected = u_i - w_i @ state  # the part of the values the state does not predict
        out.append(q_i @ state + a_i @ corrected)
        state = state * d_i + k_i.transpose(-1, -2) @ corrected
    output = torch.stack(out, 2).reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    return (output.transpose(1, 2).to(dtype).contiguous(),
            state if output_final_state else None)
