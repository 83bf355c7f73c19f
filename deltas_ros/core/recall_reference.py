"""recall.py written out one element at a time, in float64: what its tests hold the batched
summaries and scores to."""

from __future__ import annotations

import math

import torch


def mean_key_reference(keys: torch.Tensor) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, D): each layer's and head's keys summed, divided by n."""
    layers, heads, tokens, dim = keys.shape
    out = torch.zeros(layers, heads, dim, dtype=torch.float64)
    for layer in range(layers):
        for head in range(heads):
            for token in range(tokens):
                out[layer, head] += keys[layer, head, token].double()
    return (out / tokens).float()


def top_norm_keys_reference(keys: torch.Tensor, count: int) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, count, D): per layer and head, the tokens ranked by
    their key's norm, the first `count` put back in token order, the last repeated to `count`."""
    layers, heads, tokens, dim = keys.shape
    out = torch.zeros(layers, heads, count, dim)
    for layer in range(layers):
        for head in range(heads):
            norms = [float(keys[layer, head, t].double().norm()) for t in range(tokens)]
            best = sorted(sorted(range(tokens), key=lambda t: -norms[t])[:count])
            for slot in range(count):
                out[layer, head, slot] = keys[layer, head, best[min(slot, len(best) - 1)]]
    return out


def all_keys_reference(keys: torch.Tensor, capacity: int) -> torch.Tensor:
    """keys (L, H_kv, n, D) -> (L, H_kv, capacity, D): every key, then the last one repeated."""
    layers, heads, tokens, dim = keys.shape
    out = torch.zeros(layers, heads, capacity, dim)
    for slot in range(capacity):
        out[:, :, slot] = keys[:, :, min(slot, tokens - 1)]
    return out


def recall_scores_reference(queries: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """recall.recall_scores written out. queries (L, H_q, q, D); summaries (C, L, H_kv, D) or
    (C, L, H_kv, r, D) -> (C,): per chunk, layer, query head and token the largest
    q . k / sqrt(D) over the head's summary keys (one for the mean), then the mean of those."""
    layers, heads, tokens, dim = queries.shape
    scores = []
    for chunk in summaries:
        total = 0.0
        groups = heads // chunk.shape[1]
        for layer in range(layers):
            for head in range(heads):
                keys = chunk[layer, head // groups].double()
                keys = keys.unsqueeze(0) if keys.dim() == 1 else keys
                for token in range(tokens):
                    query = queries[layer, head, token].double()
                    total += max(float(query @ key) for key in keys) / math.sqrt(dim)
        scores.append(total / (layers * heads * tokens))
    return torch.tensor(scores, dtype=torch.float32)
