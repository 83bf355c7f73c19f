"""select_keep (Algorithm 1's selection) against its reference, the eviction limits, and the
retention policies' scores."""

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltas_ros.core.config import MemoryConfig
from deltas_ros.core.policy import (
    POLICY_NAMES,
    ChunkSignals,
    EvictionLimits,
    bucket_of,
    make_policy,
    select_keep,
)
from deltas_ros.core.policy_reference import select_keep_reference


def stream(chunks: int, tokens: int, seed: int = 0, distinct: bool = False):
    """Slot times and scores of `chunks` chunks of `tokens` tokens each (one score per chunk)."""
    rng = random.Random(seed)
    times, scores = [], []
    for c in range(chunks):
        score = rng.random() if distinct else rng.choice([0.1, 0.5, 0.9])
        times += [c * 1.0] * tokens
        scores += [score] * tokens
    return torch.tensor(times, dtype=torch.float64), torch.tensor(scores)


def test_keeps_everything_within_budget():
    times, scores = stream(5, 10)
    keep = select_keep(times, scores, EvictionLimits(50, sinks=2, window=10))
    assert keep.tolist() == list(range(50))


@pytest.mark.parametrize("seed", range(5))
def test_size_sinks_window_and_order(seed):
    times, scores = stream(60, 12, seed)
    keep = select_keep(times, scores, EvictionLimits(300, sinks=4, window=48, buckets=4))
    assert keep.numel() == 300
    assert torch.equal(keep, torch.sort(keep).values) and keep.unique().numel() == 300
    assert set(range(4)) <= set(keep.tolist())
    assert set(range(720 - 48, 720)) <= set(keep.tolist())


@pytest.mark.parametrize("seed", range(5))
def test_no_dropped_slot_outscores_a_kept_one_within_its_bucket(seed):
    times, scores = stream(80, 10, seed, distinct=True)
    sinks, window, buckets = 4, 30, 4
    keep = set(select_keep(times, scores, EvictionLimits(250, sinks, window, buckets)).tolist())
    candidates = torch.arange(sinks, times.numel() - window)
    bucket = torch.from_numpy(bucket_of(times[candidates].numpy(), buckets))
    for b in range(buckets):
        slots = candidates[bucket == b].tolist()
        kept = [scores[i].item() for i in slots if i in keep]
        dropped = [scores[i].item() for i in slots if i not in keep]
        if kept and dropped:
            assert max(dropped) <= min(kept)


def test_equal_time_spans_get_equal_shares():
    times, scores = stream(100, 10, seed=3, distinct=True)
    keep = select_keep(times, scores, EvictionLimits(4 + 20 + 400, sinks=4, window=20, buckets=4))
    candidates = torch.arange(4, 1000 - 20)
    bucket = torch.from_numpy(bucket_of(times[candidates].numpy(), 4)).long()
    kept_per_bucket = torch.bincount(bucket[torch.isin(candidates, keep)], minlength=4)
    assert kept_per_bucket.tolist() == [100, 100, 100, 100]


def test_spare_budget_of_a_thin_bucket_goes_to_the_best_elsewhere():
    # Bucket 0 holds one chunk of 5 slots; its share is 25, so 20 slots are spare.
    times = torch.tensor([0.0] * 5 + [30.0] * 10 + [60.0] * 10 + [90.0] * 10 + [100.0] * 10,
                         dtype=torch.float64)
    scores = torch.tensor([0.0] * 5 + [0.9] * 10 + [0.1] * 10 + [0.5] * 10 + [0.0] * 10)
    keep = select_keep(times, scores, EvictionLimits(35, sinks=0, window=10, buckets=4))
    assert keep.numel() == 35  # exactly the budget despite the thin bucket
    assert set(range(5)) <= set(keep.tolist())  # the thin bucket keeps all it has


def test_nan_scores_rank_with_minus_infinity_as_in_the_reference():
    times = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    scores = torch.tensor([-math.inf, math.nan, -math.inf, 0.0])
    for budget in (1, 2, 3):
        limits = EvictionLimits(budget, sinks=0, window=0, buckets=1)
        fast = select_keep(times, scores, limits).tolist()
        assert fast == select_keep_reference(times.tolist(), scores.tolist(), limits)
    assert select_keep(times, scores, EvictionLimits(2, 0, 0, 1)).tolist() == [2, 3]


def test_ties_go_to_the_newer_chunk():
    times, _ = stream(20, 5)
    scores = torch.zeros(100)
    keep = select_keep(times, scores, EvictionLimits(40, sinks=0, window=0, buckets=1))
    assert keep.tolist() == list(range(60, 100))


def test_nan_scores_count_as_lowest():
    times, scores = stream(20, 5, distinct=True)
    scores[50:55] = float("nan")
    keep = select_keep(times, scores, EvictionLimits(40, sinks=0, window=0, buckets=1))
    assert not set(range(50, 55)) & set(keep.tolist())


def test_limits_refuse_a_budget_smaller_than_sinks_plus_window():
    with pytest.raises(ValueError, match="budget"):
        EvictionLimits(10, sinks=4, window=8)
    with pytest.raises(ValueError, match="buckets"):
        EvictionLimits(10, buckets=0, window=0)


def test_select_keep_refuses_times_and_scores_of_other_lengths():
    times, scores = stream(10, 10)
    with pytest.raises(ValueError, match="scores"):
        select_keep(times, scores[:-1], EvictionLimits(50, sinks=2, window=10))


def test_limits_of_a_config_take_a_policy_s_pinned_buckets():
    config = MemoryConfig(budget_tokens=500, sink_tokens=3, window_tokens=40, buckets=5)
    assert EvictionLimits.of(config) == EvictionLimits(500, 3, 40, 5)
    assert EvictionLimits.of(config, make_policy("recency").buckets) == EvictionLimits(
        500, 3, 40, 1)


@settings(max_examples=150, deadline=None)
@given(
    chunk_sizes=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    scores=st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]), min_size=40, max_size=40),
    budget_extra=st.integers(0, 100),
    sinks=st.integers(0, 6),
    window=st.integers(0, 30),
    buckets=st.integers(1, 6),
)
def test_fast_path_equals_reference(chunk_sizes, scores, budget_extra, sinks, window, buckets):
    times = [float(c) for c, size in enumerate(chunk_sizes) for _ in range(size)]
    slot_scores = [scores[c] for c, size in enumerate(chunk_sizes) for _ in range(size)]
    budget = sinks + window + budget_extra
    limits = EvictionLimits(budget, sinks, window, buckets)
    fast = select_keep(torch.tensor(times, dtype=torch.float64), torch.tensor(slot_scores),
                       limits)
    assert fast.tolist() == select_keep_reference(times, slot_scores, limits)
    assert fast.numel() == min(len(times), budget)


def test_only_the_per_token_policies_score_tokens_apart():
    apart = {n for n in POLICY_NAMES if make_policy(n).score(signals(5)).unique().numel() > 1}
    assert apart == {"value_norm", "key_norm", "surprise", "deltas_surprise", "infinipot_v",
                     "streammem", "beta_error"}


def test_new_policies_are_appended_to_the_names():
    assert POLICY_NAMES[:7] == ("deltas", "recency", "uniform", "random", "value_norm",
                                "key_norm", "write_strength")


def signals(index: int, n: int = 6) -> ChunkSignals:
    gen = torch.Generator().manual_seed(index)
    kv = [torch.randn(1, 2, n, 8, generator=gen) for _ in range(2)]
    per_token = torch.rand(n, generator=gen)
    frames = [np.full((4, 4, 3), index, np.uint8)] * 2
    return ChunkSignals(index=index, num_tokens=n, drift=0.1 * index, keys=kv,
                        values=[2 * t for t in kv], write_strength=0.5, recorded=per_token,
                        saliency=per_token / n, frames=frames)


def test_surprise_policies_rank_by_the_recorded_signal():
    chunk = signals(2)
    assert torch.equal(make_policy("surprise").score(chunk), chunk.recorded)
    assert torch.equal(make_policy("beta_error").score(chunk), chunk.recorded)
    combined = make_policy("deltas_surprise").score(chunk)
    assert torch.equal(torch.argsort(combined), torch.argsort(chunk.recorded))
    assert combined.max().item() == pytest.approx(chunk.drift, rel=1e-4)
    assert {make_policy(n).records for n in ("surprise", "deltas_surprise")} == {"surprise"}
    assert make_policy("beta_error").records == "write_strength"


def test_policies_that_compare_with_the_previous_chunk_forget_it_on_reset():
    for name in ("infinipot_v", "pixel_difference"):
        policy = make_policy(name)
        first = policy.score(signals(1))
        again = policy.score(signals(1))
        assert not torch.equal(first, again), name  # the same chunk twice: nothing new
        policy.reset()
        assert torch.equal(policy.score(signals(1)), first), name
    assert make_policy("pixel_difference").score(signals(1)).unique().tolist() == [1.0]


def test_infinipot_v_keeps_novel_salient_tokens():
    """TaR x VaN: a token whose key repeats the last chunk's scores 0, a changed one its value
    norm times (1 - cosine)."""
    policy, chunk = make_policy("infinipot_v"), signals(1)
    policy.score(chunk)
    keys = [k.clone() for k in chunk.keys]
    for k in keys:
        k[..., 0, :] = -k[..., 0, :]  # first token's key reversed: cosine -1
    scores = policy.score(ChunkSignals(2, 6, 0.0, keys, chunk.values))
    norms = torch.stack([v[0].norm(dim=-1).mean(0) for v in chunk.values]).mean(0)
    torch.testing.assert_close(scores, torch.cat([2 * norms[:1], torch.zeros(5)]))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_scores_every_token(name):
    scores = make_policy(name).score(signals(3))
    assert scores.shape == (6,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()


def test_random_policy_is_seeded():
    a, b = make_policy("random", seed=1), make_policy("random", seed=1)
    c = make_policy("random", seed=2)
    assert torch.equal(a.score(signals(4)), b.score(signals(4)))
    assert not torch.equal(a.score(signals(4)), c.score(signals(4)))


def test_uniform_policy_spreads_kept_chunks_evenly():
    policy = make_policy("uniform")
    times = torch.arange(64, dtype=torch.float64)
    scores = torch.cat([policy.score(signals(i, n=1)) for i in range(64)])
    kept = select_keep(times, scores, EvictionLimits(8, sinks=0, window=0, buckets=1))
    gaps = torch.diff(kept)
    assert gaps.min() == gaps.max() == 8


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="deltas"):
        make_policy("oracle")
