"""Which KV cache slots to keep: one selection rule (Algorithm 1), many retention signals.

Every policy shares the same budget M, attention sinks, recent window and temporal buckets; only
the per-token score differs (the paper's controlled comparison, Table 2):

    keep = sinks (first n_s slots) + window (last n_w slots)
           + per temporal bucket of the rest, the highest-scored slots up to an equal share.

Decisions the paper leaves open, taken here (as docs/method.md, Eviction, states them):
- Buckets are N equal spans of *stream time* (chunk arrival time), not of slot count.
- Each bucket's share is (M - n_s - n_w) // N; the remainder goes to the newest buckets.
- Ties go to the newer chunk (then the later slot).
- A bucket with fewer candidates than its share leaves spare budget; the spare goes to the best
  remaining candidates of any bucket, so the cache holds exactly M slots after every eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .config import POLICY_NAMES, MemoryConfig
from .signals import lexicographic, pixel_difference, temporal_redundancy


@dataclass(frozen=True)
class EvictionLimits:
    """What every eviction keeps to, whatever the policy: the budget M, the first `sinks` slots,
    the last `window` slots and the number of temporal buckets. One value, built from the
    memory's config when it evicts (`of`), so the four travel together and are checked once."""

    budget: int
    sinks: int = MemoryConfig.sink_tokens
    window: int = MemoryConfig.window_tokens
    buckets: int = MemoryConfig.buckets

    def __post_init__(self) -> None:
        if min(self.sinks, self.window) < 0 or self.buckets < 1:
            raise ValueError("sinks and window must be >= 0 and buckets >= 1")
        if self.budget < self.sinks + self.window:
            raise ValueError(f"budget {self.budget} must hold the sinks ({self.sinks}) + "
                             f"window ({self.window})")

    @classmethod
    def of(cls, config: MemoryConfig, buckets: int | None = None) -> EvictionLimits:
        """The config's limits; `buckets`: a policy's own number (None: the config's)."""
        return cls(config.budget_tokens, config.sink_tokens, config.window_tokens,
                   buckets or config.buckets)


def select_keep(times: torch.Tensor | np.ndarray, scores: torch.Tensor | np.ndarray,
                limits: EvictionLimits) -> torch.LongTensor:
    """Sorted cache-slot indices to keep: exactly min(T, limits.budget) of them.

    times:  (T,) arrival time of each slot's chunk, non-decreasing in slot order
    scores: (T,) retention score of each slot (higher is kept first; NaN counts as lowest)
    Host tensors or arrays (the slot table lives on the host); the result is a host tensor.

    Two stable sorts: because times never decrease along the slots, "newer chunk, then later
    slot" is simply "later slot", so best-first is one stable sort by score of the candidates
    in reverse slot order, and a stable sort of that order by bucket ranks each bucket. The
    result comes from a keep mask, already sorted. In numpy: at a few thousand slots each op
    costs about a microsecond, a torch op on the CPU several (the eviction's budget is 1 % of a
    tiny model's forward). `policy_reference.select_keep_reference` is the loop it is tested
    against.
    """
    times, scores = np.asarray(times), np.asarray(scores)
    total = times.size
    if scores.size != total:
        raise ValueError(f"{total} times but {scores.size} scores")
    budget, sinks, window, buckets = (limits.budget, limits.sinks, limits.window,
                                      limits.buckets)
    if total <= budget:
        return torch.arange(total)
    candidates = np.arange(total - window - 1, sinks - 1, -1)  # newest first
    cand_scores = scores[candidates].astype(np.float32)
    cand_scores[np.isnan(cand_scores)] = -np.inf  # ties with -inf
    best_first = np.argsort(-cand_scores, kind="stable")
    bucket = bucket_of(times[candidates], buckets)
    by_bucket = best_first[np.argsort(bucket[best_first], kind="stable")]

    # Rank inside each bucket; the top `share` of each are kept.
    counts = np.bincount(bucket, minlength=buckets)
    starts = np.cumsum(counts) - counts
    ordered_bucket = bucket[by_bucket]
    rank = np.arange(by_bucket.size) - starts[ordered_bucket]
    in_share = np.zeros(candidates.size, dtype=bool)
    shares = np.asarray(bucket_shares(budget - sinks - window, buckets))
    in_share[by_bucket] = rank < shares[ordered_bucket]

    # Spare budget (buckets thinner than their share) goes to the best of the rest, any bucket.
    spare = budget - sinks - window - int(in_share.sum())
    rest = best_first[~in_share[best_first]][:spare]
    keep = np.zeros(total, dtype=bool)
    keep[:sinks] = True
    keep[total - window:] = True
    keep[candidates[in_share]] = True
    keep[candidates[rest]] = True
    return torch.from_numpy(np.flatnonzero(keep))


def bucket_of(times: np.ndarray, buckets: int) -> np.ndarray:
    """Index of the equal stream-time span each time falls in (int16: numpy sorts it by radix).
    """
    lo, hi = times.min(), times.max()
    if hi <= lo:
        return np.zeros(times.size, dtype=np.int16)
    fraction = (times.astype(np.float64) - lo) / (float(hi) - float(lo))
    return np.minimum((fraction * buckets).astype(np.int64), buckets - 1).astype(np.int16)


def bucket_shares(free: int, buckets: int) -> list[int]:
    """Each bucket's share of `free` slots: equal, the remainder to the newest buckets."""
    base, extra = divmod(free, buckets)
    return [base + (b >= buckets - extra) for b in range(buckets)]


@dataclass
class ChunkSignals:
    """What a retention policy may score a freshly prefilled chunk by.

    keys, values: the chunk's new cache entries, one (B, kv_heads, n, head_dim) tensor per
    full-attention layer. write_strength: mean beta_t * ||v_t - alpha_t S_{t-1} k_t|| over the
    chunk's tokens, linear layers and heads. recorded: (n,) the per-token signal the policy
    records from the gated delta prefill (`RetentionPolicy.records`), mean over linear layers.
    saliency: (n,) the proxy query's attention on the chunk's slots. frames: its RGB frames.
    Each is only computed for the policies that ask for it.
    """

    index: int
    num_tokens: int
    drift: float
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    write_strength: float | None = None
    recorded: torch.Tensor | None = None
    saliency: torch.Tensor | None = None
    frames: Sequence[np.ndarray] = ()


class RetentionPolicy:
    """A per-token score for each new chunk; `select_keep` does the rest.

    buckets: None = the memory's setting; a policy may pin it (recency uses one bucket).
    records: which per-token signal the gated delta prefill records for it ("write_strength":
    the token-by-token replay, "surprise": against the state before the chunk), or None.
    A policy that compares a chunk with the previous one keeps that chunk itself; `reset`
    (a new stream) forgets it. It is no part of a saved memory: after a load, the first chunk
    compares with the last one this instance saw (a fresh one: with none).
    """

    name = ""
    buckets: int | None = None
    records: str | None = None
    needs_saliency = False

    def score(self, chunk: ChunkSignals) -> torch.Tensor:
        """(num_tokens,) float32 scores for the chunk's tokens."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the stream (a new one starts, or a saved one is loaded)."""


class ChunkScorePolicy(RetentionPolicy):
    """One score per chunk, `chunk_score(chunk)`, given to each of its tokens: DeltaS and the
    per-chunk baselines."""

    def __init__(self, name: str, chunk_score: Callable[[ChunkSignals], float],
                 buckets: int | None = None, records: str | None = None) -> None:
        self.name, self.chunk_score, self.buckets, self.records = (name, chunk_score, buckets,
                                                                   records)

    def score(self, chunk: ChunkSignals) -> torch.Tensor:
        return torch.full((chunk.num_tokens,), float(self.chunk_score(chunk)))


class TokenScorePolicy(RetentionPolicy):
    """A score per token, `token_score(chunk)` -> (num_tokens,): a chunk that only partly fits
    its bucket keeps its best tokens."""

    def __init__(self, name: str, token_score: Callable[[ChunkSignals], torch.Tensor],
                 records: str | None = None, needs_saliency: bool = False) -> None:
        self.name, self.token_score, self.records = name, token_score, records
        self.needs_saliency = needs_saliency

    def score(self, chunk: ChunkSignals) -> torch.Tensor:
        return self.token_score(chunk).float()


class InfiniPotVPolicy(RetentionPolicy):
    """InfiniPot-V's two query-agnostic criteria in one score: temporal-axis novelty of a key
    against the most recent frame's key at the same place (1 - cosine, TaR) times the token's
    value norm (VaN), so a kept token is both new and salient."""

    name = "infinipot_v"

    def __init__(self) -> None:
        self.previous: list[torch.Tensor] | None = None

    def score(self, chunk: ChunkSignals) -> torch.Tensor:
        novelty = 1.0 - temporal_redundancy(chunk.keys, self.previous)
        self.previous = [k.clone() for k in chunk.keys]
        return novelty * _mean_token_norm(chunk.values)

    def reset(self) -> None:
        self.previous = None


class PixelDifferencePolicy(RetentionPolicy):
    """Mean absolute pixel change from the previous chunk's frames, one score per chunk."""

    name = "pixel_difference"

    def __init__(self) -> None:
        self.previous: list[np.ndarray] | None = None

    def score(self, chunk: ChunkSignals) -> torch.Tensor:
        change = pixel_difference(chunk.frames, self.previous)
        self.previous = [np.array(frame) for frame in chunk.frames]
        return torch.full((chunk.num_tokens,), change)

    def reset(self) -> None:
        self.previous = None


def make_policy(name: str, seed: int = 0) -> RetentionPolicy:
    """The retention policy called `name` (one of POLICY_NAMES), a fresh instance."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    if name == "infinipot_v":
        return InfiniPotVPolicy()
    if name == "pixel_difference":
        return PixelDifferencePolicy()
    if name in CHUNK_SCORES:
        score, buckets, records = CHUNK_SCORES[name]
        return ChunkScorePolicy(name, lambda chunk: score(chunk, seed), buckets, records)
    score, records, needs_saliency = TOKEN_SCORES[name]
    return TokenScorePolicy(name, score, records, needs_saliency)


# name -> (score of a chunk given the seed, buckets pinned or None, signal the prefill records)
CHUNK_SCORES: dict[str, tuple[Callable[[ChunkSignals, int], float], int | None, str | None]] = {
    # DeltaS: the chunk's state drift.
    "deltas": (lambda c, _: c.drift, None, None),
    # Sliding window: one bucket scored by arrival, so the newest M - n_s slots stay.
    "recency": (lambda c, _: c.index, 1, None),
    # Evenly spaced chunks: the top-k of the van der Corput sequence over any range of indices
    # is spread evenly across it, and stays so as chunks arrive and are evicted.
    "uniform": (lambda c, _: _van_der_corput(c.index + 1), None, None),
    # A seeded random score per chunk, reproducible for a seed and chunk index.
    "random": (lambda c, seed: _seeded_uniform(seed, c.index), None, None),
    # beta * ||e||: the gated delta rule's token-level write strength, averaged per chunk.
    "write_strength": (lambda c, _: c.write_strength, None, "write_strength"),
}
# name -> (per-token scores of a chunk, signal the prefill records, needs the proxy saliency)
TOKEN_SCORES: dict[str, tuple[Callable[[ChunkSignals], torch.Tensor], str | None, bool]] = {
    # VaN: value norm, averaged over full-attention layers and KV heads.
    "value_norm": (lambda c: _mean_token_norm(c.values), None, False),
    # Key norm (post-rotary), averaged over full-attention layers and KV heads.
    "key_norm": (lambda c: _mean_token_norm(c.keys), None, False),
    # State surprise: each token's write against the state before the chunk
    # (signals.state_surprise): a chunk keeps the tokens the state did not predict.
    "surprise": (lambda c: c.recorded, "surprise", False),
    # DeltaS across chunks, surprise within one: a bucket fills with the highest-drift chunks,
    # and the chunk that only partly fits keeps its most surprising tokens.
    "deltas_surprise": (lambda c: lexicographic(c.drift, c.recorded), "surprise", False),
    # StreamMem's saliency: the attention the chat template's generic query (the assistant-turn
    # opening) puts on each token over the full-attention layers, at arrival.
    "streammem": (lambda c: c.saliency, None, True),
    # The paper's token-level state baseline: beta_t * ||v_t - alpha_t S_{t-1} k_t|| per token,
    # replayed token by token with decay (signals.write_strength), not averaged per chunk.
    "beta_error": (lambda c: c.recorded, "write_strength", False),
}


def _seeded_uniform(seed: int, index: int) -> float:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.rand((), generator=gen).item()


def _mean_token_norm(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """(B, H, n, d) per layer -> (n,) mean L2 norm over layers and heads (batch 0)."""
    norms = torch.stack([t[0].float().norm(dim=-1).mean(0) for t in per_layer])
    return norms.mean(0).cpu()


def _van_der_corput(n: int) -> float:
    """n-th element of the base-2 van der Corput sequence (bit-reversed fraction)."""
    value, denom = 0.0, 1.0
    while n:
        denom *= 2
        value += (n & 1) / denom
        n >>= 1
    return value
