"""Which tiered chunks a question calls back: each chunk's key summary scored by the question's
queries, the best ones taken up to a token budget.

A chunk that left the GPU keeps, beside its K/V, one small summary per full-attention layer and
KV head: the mean of its keys (ReKV's block representation). A question's queries at those
layers, from its prefill over the GPU tier, score every summary at once; the score is the
attention logit the chunk's mean key would get, averaged over layers, query heads and the
question's tokens. `recall_scores_reference` is the same, one chunk and one head at a time.
"""

from __future__ import annotations

import math

import torch


def key_summary(keys: torch.Tensor) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, D) float32: the mean key of each layer and KV head."""
    return keys.float().mean(2)


def recall_scores(queries: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """queries (L, H_q, q, D), summaries (C, L, H_kv, D) -> (C,) one score per chunk.

    H_q is a multiple of H_kv (grouped-query attention: query head h reads KV head
    h // (H_q // H_kv)); scores are q . k / sqrt(D), averaged over layers, heads and tokens.
    """
    layers, heads, _, dim = queries.shape
    if summaries.numel() == 0:
        return torch.empty(0)
    groups = heads // summaries.shape[2]
    mean_query = queries.float().mean(2).reshape(layers, summaries.shape[2], groups, dim)
    logits = torch.einsum("lkgd,clkd->c", mean_query, summaries.float())
    return logits / (layers * heads * math.sqrt(dim))


def recall_scores_reference(queries: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """`recall_scores` written out: every chunk, layer, query head and token one at a time."""
    layers, heads, tokens, dim = queries.shape
    scores = []
    for chunk in summaries:
        total = 0.0
        for layer in range(layers):
            groups = heads // chunk.shape[1]
            for head in range(heads):
                key = chunk[layer, head // groups].double()
                for token in range(tokens):
                    total += float(queries[layer, head, token].double() @ key) / math.sqrt(dim)
        scores.append(total / (layers * heads * tokens))
    return torch.tensor(scores, dtype=torch.float32)


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
