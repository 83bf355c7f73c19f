"""Which tiered chunks a question calls back: each chunk's key summary scored by the question's
queries, the best ones taken up to a token budget.

A chunk that left the GPU keeps, beside its K/V, one small summary per full-attention layer and
KV head, which a question's queries at those layers (from its prefill over the GPU tier) score
for every chunk at once. Summary kinds (`SUMMARY_KINDS`, made by `summarizer`):

- `mean`: the mean of its keys (ReKV's block representation), scored by the attention logit
  it would get, averaged over layers, query heads and the question's tokens;
- `top-norm`: its `REPRESENTATIVES` keys of largest norm (a query-agnostic stand-in for
  InfLLM's representative tokens), each query token taking its best logit among them;
- `all-keys`: every key, scored the same way: what scoring token by token could reach, at the
  cost of keeping every key beside the index.

`key_summary` is what the store keeps by default: `top-norm` at the first full-attention layer
alone, the one layer whose queries the memory recalls by (asking.recall_chunks).
recall_reference.py writes each kind out one element at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

REPRESENTATIVES = 4  # keys per layer and KV head that `top-norm` keeps
SUMMARY_KINDS = ("mean", "top-norm", "all-keys")


def mean_key(keys: torch.Tensor) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, D) float32: the mean key of each layer and KV head."""
    return keys.float().mean(2)


def top_norm_keys(keys: torch.Tensor, count: int = REPRESENTATIVES) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, count, D) float32: per layer and KV head the `count`
    keys of largest norm, in token order; a chunk of fewer keys repeats its last one (a set's
    best logit is unchanged by a repeat), so every chunk's summary stacks."""
    keys = keys.float()
    chosen = keys.norm(dim=-1).topk(min(count, keys.shape[2]), dim=-1).indices.sort(-1).values
    picked = keys.gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    return _padded(picked, count)


def all_keys(keys: torch.Tensor, capacity: int) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, capacity, D) float32: every key, the last repeated up
    to `capacity` (the largest chunk's tokens) so that every chunk's summary stacks."""
    if keys.shape[2] > capacity:
        raise ValueError(f"a chunk of {keys.shape[2]} keys exceeds the capacity {capacity}")
    return _padded(keys.float(), capacity)


def _padded(keys: torch.Tensor, size: int) -> torch.Tensor:
    """keys (L, H_kv, n, D), n <= size -> (L, H_kv, size, D): the last key repeated."""
    return torch.cat([keys, keys[:, :, -1:].expand(-1, -1, size - keys.shape[2], -1)], 2)


def summarizer(kind: str, chunk_tokens: int, every_layer: bool = False
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The summary function of `kind` (TierStore.summarize): keys (L, H_kv, n, D) -> the
    chunk's summary of the first layer's keys (every_layer: of every layer's), its first axis
    the layers kept; `chunk_tokens` bounds n (used by `all-keys` only)."""
    if kind not in SUMMARY_KINDS:
        raise ValueError(f"unknown summary kind {kind!r} (one of {', '.join(SUMMARY_KINDS)})")
    summarize = {"mean": mean_key, "top-norm": top_norm_keys,
                 "all-keys": lambda keys: all_keys(keys, chunk_tokens)}[kind]
    return summarize if every_layer else lambda keys: summarize(keys[:1])


def key_summary(keys: torch.Tensor) -> torch.Tensor:
    """The summary a tier store keeps by default: `top_norm_keys` of the first full-attention
    layer, (L, H_kv, n, D) -> (1, H_kv, REPRESENTATIVES, D). On the busy streams it recalls the
    asked object where the mean key recalls none (docs/evaluation.md, "Recall from the second
    tier"); the other layers' would be kept for nothing (at 9B, 8x the memory: about 0.5 GB an
    hour of stream)."""
    return top_norm_keys(keys[:1])


def recall_scores(queries: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """queries (L, H_q, q, D), summaries (C, L, H_kv, D) or (C, L, H_kv, r, D) -> (C,) one score
    per chunk.

    H_q is a multiple of H_kv (grouped-query attention: query head h reads KV head
    h // (H_q // H_kv)). One key per head (the mean): q . k / sqrt(D), averaged over layers,
    heads and tokens. r keys per head: each query token's largest q . k / sqrt(D) among them,
    averaged the same way.
    """
    if summaries.numel() == 0:
        return torch.empty(0)
    layers, heads, tokens, dim = queries.shape
    kv_heads = summaries.shape[2]
    grouped = queries.float().reshape(layers, kv_heads, heads // kv_heads, tokens, dim)
    if summaries.dim() == 4:
        logits = torch.einsum("lkgd,clkd->c", grouped.mean(3), summaries.float())
        return logits / (layers * heads * math.sqrt(dim))
    chunks, reps = summaries.shape[0], summaries.shape[3]
    # one matmul per layer and KV head: (G*q, D) x (D, C*r), as BLAS runs it fastest
    keys = summaries.float().permute(1, 2, 0, 3, 4).reshape(layers, kv_heads, chunks * reps, dim)
    logits = grouped.reshape(layers, kv_heads, -1, dim) @ keys.transpose(-1, -2)
    best = logits.view(layers, kv_heads, -1, chunks, reps).amax(-1)
    return best.sum((0, 1, 2)) / (layers * heads * tokens * math.sqrt(dim))


def choose_recall(scores: torch.Tensor, tokens: torch.Tensor, budget: int) -> list[int]:
    """Indices of the chunks to call back: best score first, each taken while it fits in
    `budget` tokens (a chunk too large for what is left is skipped, a smaller one may follow);
    returned in index order. scores, tokens: (C,)."""
    chosen, left = [], budget
    for index in torch.argsort(scores, descending=True, stable=True).tolist():
        if int(tokens[index]) <= left:
            chosen.append(index)
            left -= int(tokens[index])
    return sorted(chosen)
