"""Recall scoring without a model: every summary kind and the scores against their references
(recall_reference.py), the bounds between kinds, and the choice within a token budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltas_ros.core.recall import (
    REPRESENTATIVES,
    SUMMARY_KINDS,
    all_keys,
    choose_recall,
    key_summary,
    mean_key,
    recall_scores,
    summarizer,
    top_norm_keys,
)
from deltas_ros.core.recall_reference import (
    all_keys_reference,
    mean_key_reference,
    recall_scores_reference,
    top_norm_keys_reference,
)

LAYERS, HEADS, DIM = 2, 2, 4


def keys_of(tokens: int, seed: int) -> torch.Tensor:
    """(LAYERS, HEADS, tokens, DIM) random keys."""
    return torch.randn(LAYERS, HEADS, tokens, DIM, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 9), seed=st.integers(0, 1000))
def test_summaries_match_their_references(tokens, seed):
    keys = keys_of(tokens, seed)
    torch.testing.assert_close(mean_key(keys), mean_key_reference(keys))
    assert torch.equal(top_norm_keys(keys), top_norm_keys_reference(keys, REPRESENTATIVES))
    assert torch.equal(all_keys(keys, 9), all_keys_reference(keys, 9))


def test_every_kind_summarizes_chunks_of_any_size_to_one_shape():
    for kind in SUMMARY_KINDS:
        summarize = summarizer(kind, chunk_tokens=9)
        shapes = {summarize(keys_of(tokens, tokens)).shape for tokens in (1, 4, 9)}
        assert len(shapes) == 1, kind
    with pytest.raises(ValueError, match="capacity"):
        all_keys(keys_of(10, 0), 9)
    with pytest.raises(ValueError, match="unknown"):
        summarizer("median", 9)


def test_the_store_keeps_the_first_layers_keys_of_largest_norm_by_default():
    keys = keys_of(5, 3)
    assert keys.shape[0] > 1
    assert torch.equal(key_summary(keys), top_norm_keys(keys[:1]))
    for kind in SUMMARY_KINDS:
        assert summarizer(kind, 9)(keys).shape[0] == 1
        assert summarizer(kind, 9, every_layer=True)(keys).shape[0] == keys.shape[0]


@settings(max_examples=30, deadline=None)
@given(chunks=st.integers(0, 5), tokens=st.integers(1, 4), groups=st.sampled_from([1, 2]),
       kind=st.sampled_from(SUMMARY_KINDS), seed=st.integers(0, 1000))
def test_recall_scores_match_the_reference(chunks, tokens, groups, kind, seed):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(LAYERS, HEADS * groups, tokens, DIM, generator=g)
    summarize = summarizer(kind, chunk_tokens=6, every_layer=True)
    summaries = torch.stack([summarize(keys_of(1 + (seed + c) % 6, seed + c))
                             for c in range(chunks)]) if chunks else torch.empty(0, 0, 0, 0)
    torch.testing.assert_close(recall_scores(queries, summaries),
                               recall_scores_reference(queries, summaries),
                               rtol=1e-4, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 9), seed=st.integers(0, 1000))
def test_every_key_bounds_the_mean_and_the_representatives(tokens, seed):
    """Each query token's best logit over all keys is at least its logit on their mean (a
    convex combination) and its best over any subset."""
    keys = keys_of(tokens, seed)
    g = torch.Generator().manual_seed(seed + 7)
    queries = torch.randn(LAYERS, 2 * HEADS, 3, DIM, generator=g)
    every = recall_scores(queries, all_keys(keys, 9)[None])
    assert every >= recall_scores(queries, mean_key(keys)[None]) - 1e-5
    assert every >= recall_scores(queries, top_norm_keys(keys)[None]) - 1e-5


def test_the_chunk_whose_keys_match_the_question_scores_highest():
    g = torch.Generator().manual_seed(0)
    summaries = torch.randn(6, LAYERS, HEADS, DIM, generator=g)
    queries = summaries[4].unsqueeze(2).repeat(1, 1, 3, 1) * 5
    assert int(recall_scores(queries, summaries).argmax()) == 4


def test_choose_recall_takes_the_best_that_fit():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.8])
    tokens = torch.tensor([2, 5, 2, 4])
    assert choose_recall(scores, tokens, budget=7) == [1, 2]
    assert choose_recall(scores, tokens, budget=6) == [1]
    assert choose_recall(scores, tokens, budget=4) == [3]
    assert choose_recall(scores, tokens, budget=0) == []
