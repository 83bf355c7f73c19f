"""bench/evidence_candidates.py: what a search over the attention's first k candidates reports,
read off the full search, and a smoke run on the shipped model."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench import evidence_candidates as ec


@st.composite
def rankings(draw) -> tuple[list[float], list[float], list[float]]:
    """(attended, searched, drops): a candidate order, the order of their drops, the drops."""
    n = draw(st.integers(1, 12))
    attended = [float(t) for t in draw(st.permutations(range(n)))]
    drops = draw(st.lists(st.floats(0, 2), min_size=n, max_size=n))
    searched = [attended[i] for i in sorted(range(n), key=lambda i: -drops[i])]
    return attended, searched, drops


@given(rankings(), st.integers(0, 14))
def test_a_k_search_ranks_its_k_by_drop_then_the_rest_by_attention(ranked, k):
    attended, searched, drops = ranked
    mine = ec.k_search(attended, searched, k)
    assert sorted(mine) == sorted(attended)
    tested = mine[:min(k, len(attended))]
    assert set(tested) == set(attended[:k])
    assert mine[len(tested):] == attended[k:]
    drop = dict(zip(attended, drops))
    assert [drop[c] for c in tested] == sorted((drop[c] for c in tested), reverse=True)
    if k >= len(attended):
        assert mine == searched


def test_agreement_counts_hits_overlap_and_material_drops():
    """Three questions ranked by attention: the winner third by attention, all drops tied at 0
    (no chunk carries the answer: not material), the winner last by attention."""
    chunks = [1.0, 2.0, 3.0, 4.0]
    third = {"chunks": chunks, "drops": [0.2, 0.1, 0.5, 0.0], "shown": [[2.0, 3.0]]}
    tied = {"chunks": chunks, "drops": [0.0] * 4, "shown": []}
    last = {"chunks": chunks, "drops": [0.05, 0.0, 0.1, 0.3], "shown": [[0.0, 0.5], [4.5, 5.0]]}
    records = [third, tied, last]
    assert ec.ranking(third, "drop") == [3.0, 1.0, 2.0, 4.0]
    assert ec.ranking(tied, "drop") == chunks  # ties keep the attention order
    at_2 = ec.agreement(records, 2, "attention")
    assert at_2["top1"] == [1, 3] and at_2["material_top1"] == [0, 2]
    assert at_2["top3_overlap"] == pytest.approx((1 + 1 + 2 / 3) / 3)  # untested fill in
    assert at_2["top3_same"] == [2, 3]
    assert at_2["material_captured"] == pytest.approx((0.2 / 0.5 + 0.05 / 0.3) / 2)
    assert at_2["at_event"] == [2, 2]  # 1.0 lies within 1 s of [2, 3] and of [0, 0.5]
    at_3 = ec.agreement(records, 3, "attention")
    assert at_3["top1"] == [2, 3] and at_3["material_top1"] == [1, 2]
    assert at_3["material_captured"] == pytest.approx((1 + 0.1 / 0.3) / 2)
    assert at_3["at_event"] == [1, 2]  # 3.0 lies 2.5 s after [0, 0.5], 1.5 s before [4.5, 5]
    assert ec.agreement(records, 4, "attention")["at_event"] == [2, 2]
    rows = [ec.agreement(records, k, "attention") for k in (1, 2, 3, 4)]
    assert rows[-1]["top1"] == [3, 3] and rows[-1]["material_captured"] == 1.0
    assert ec.default_k(rows) == 4
    assert ec.default_k(rows[:3]) is None


def test_a_ranking_by_estimate_tests_the_largest_estimates_first():
    """The estimates put the winner second: one candidate misses it, two find it."""
    record = {"chunks": [1.0, 2.0, 3.0], "drops": [0.0, 0.4, 0.1],
              "estimates": [0.3, 0.2, -0.1], "shown": []}
    assert ec.ranking(record, "estimate") == [1.0, 2.0, 3.0]
    assert ec.k_search(ec.ranking(record, "estimate"), ec.ranking(record, "drop"), 1)[0] == 1.0
    assert ec.agreement([record], 1, "estimate")["top1"] == [0, 1]
    assert ec.agreement([record], 2, "estimate")["top1"] == [1, 1]
    assert ec.agreement([record], 1, "attention")["top1"] == [0, 1]


@pytest.mark.slow  # streams through the shipped model
def test_evidence_candidates_bench_runs_and_ranks_every_chunk_both_ways(tmp_path):
    torch.set_num_threads(1)
    ec.main(["--streams", "1", "--settings", "2:8", "--ks", "1", "4", "--out", str(tmp_path)])
    records = [json.loads(line)
               for line in (tmp_path / "evidence_candidates.jsonl").read_text().splitlines()]
    shown = [r for r in records if r["kind"] == "seen: shown"]
    assert shown and all(r["shown"] for r in shown)
    assert not any(r["shown"] for r in records if r["kind"] != "seen: shown")
    kept = ec.usable(records)
    assert kept
    for r in kept:
        assert len(r["chunks"]) == len(set(r["chunks"])) == 8  # every chunk of the 8 s
        assert len(r["drops"]) == len(r["estimates"]) == 8
    summary = json.loads((tmp_path / "evidence_candidates.json").read_text())
    assert summary["tables"]["all, by estimate"][0]["n"] == len(kept)
