"""An answer's evidence: the chunks whose absence lowers the answer's likelihood most, found by
leaving each candidate out once (asking.leave_one_out), checked against removing the chunk from
a copy of the cache for real."""

import math

import pytest
import torch
from engine_helpers import TINY_FRAMES, assert_same_state, feed, frozen

from deltas_ros import asking
from deltas_ros.asking import by_drop, leave_one_out
from deltas_ros.memory import MemoryConfig, StreamingMemory

CONFIG = MemoryConfig(budget_tokens=10_000, window_tokens=8, max_new_tokens=4, **TINY_FRAMES)
CHUNKS = 6


@pytest.fixture(scope="module")
def memory(tiny_model) -> StreamingMemory:
    memory = StreamingMemory(tiny_model, CONFIG)
    feed(memory, range(CHUNKS))
    return memory


def reference_log_prob(tiny_model, state, ids: list[int], answer: list[int],
                       keep: torch.Tensor | None) -> float:
    """log p(answer | question) from a copy of the memory whose cache holds only `keep` (T,)
    bool: the chunk removed for real (the eviction primitive), the model called directly."""
    copy = StreamingMemory(tiny_model, CONFIG)
    copy.import_state(state)
    if keep is not None:
        copy.backend.keep(keep.nonzero().squeeze(1))
    tokens = ids + answer
    start = copy.next_position
    positions = torch.arange(start, start + len(tokens)).expand(3, 1, -1)
    with torch.inference_mode():
        hidden = copy.model.model(input_ids=torch.tensor([tokens]), position_ids=positions,
                                  cache=copy.backend.cache, use_cache=True).last_hidden_state
        scores = torch.log_softmax(copy.model.lm_head(hidden[0, len(ids) - 1:-1]), dim=-1)
    return sum(float(scores[i, token]) for i, token in enumerate(answer))


def test_leaving_a_chunk_out_equals_removing_it_from_the_cache(memory, tiny_model):
    ids = memory.layout.question_ids(memory.tokenizer, "What color was the ball?")
    answer = memory.tokenizer.encode(" a red ball", add_special_tokens=False)
    before = frozen(memory)
    with torch.inference_mode():
        snapshot = memory.backend.snapshot()
        drops = leave_one_out(memory.backend, memory.slots, ids, answer, memory.next_position,
                              list(range(CHUNKS)), None,
                              lambda: memory.backend.restore(snapshot), math.inf)
    assert_same_state(frozen(memory), before)  # restored after every forward

    full = reference_log_prob(tiny_model, frozen(memory), ids, answer, None)
    expected = {c: full - reference_log_prob(tiny_model, frozen(memory), ids, answer,
                                             memory.slots.chunk != c) for c in range(CHUNKS)}
    assert drops.keys() == expected.keys()
    for c in range(CHUNKS):
        assert drops[c] == pytest.approx(expected[c], abs=1e-4), c
    assert len({round(d, 4) for d in drops.values()}) > 1  # the chunks do differ


def test_past_the_deadline_the_candidates_keep_the_attention_order(memory):
    with torch.inference_mode():
        snapshot = memory.backend.snapshot()
        drops = leave_one_out(memory.backend, memory.slots, [1, 2], [3], memory.next_position,
                              [4, 1, 2], None, lambda: memory.backend.restore(snapshot), 0.0)
    assert drops == {}
    assert by_drop([4, 1, 2], drops) == [4, 1, 2]


def test_largest_drop_first_ties_and_untested_in_their_order():
    assert by_drop([5, 3, 9, 7], {5: 0.1, 3: 2.0, 9: 0.1}) == [3, 5, 9, 7]


def test_evidence_is_the_chunks_with_the_largest_drop(tiny_model, monkeypatch):
    """ask() reports the chunks leave_one_out ranks first; with no candidates, the chunks the
    answer attended to most; either way the answer is the same and the memory bit-identical."""
    seen = []

    def recorded(*args):
        seen.append(leave_one_out(*args))
        return seen[-1]

    monkeypatch.setattr(asking, "leave_one_out", recorded)
    reports = {}
    for candidates in (0, CHUNKS):
        memory = StreamingMemory(tiny_model, MemoryConfig(
            budget_tokens=10_000, window_tokens=8, max_new_tokens=4, evidence_chunks=CHUNKS,
            evidence_candidates=candidates, **TINY_FRAMES))
        feed(memory, range(CHUNKS))
        before = frozen(memory)
        reports[candidates] = memory.ask("What color was the ball?")
        assert_same_state(frozen(memory), before)
    assert len(seen) == 1 and len(seen[0]) == CHUNKS  # only with candidates, each tested
    assert reports[0].text == reports[CHUNKS].text  # the evidence never changes the answer
    assert sorted(reports[0].evidence_times) == sorted(reports[CHUNKS].evidence_times)
    ranked = sorted(seen[0], key=seen[0].__getitem__, reverse=True)
    assert reports[CHUNKS].evidence_times == [c + 0.25 for c in ranked]


def test_a_cancel_stops_the_test_between_candidates(memory):
    asked = []

    def cancelled() -> bool:
        asked.append(True)
        return len(asked) > 2  # after two candidates

    with torch.inference_mode():
        snapshot = memory.backend.snapshot()
        drops = leave_one_out(memory.backend, memory.slots, [1, 2], [3], memory.next_position,
                              [4, 1, 2, 0], None, lambda: memory.backend.restore(snapshot),
                              math.inf, cancelled)
    assert list(drops) == [4, 1]
    assert by_drop([4, 1, 2, 0], drops)[2:] == [2, 0]
