"""An answer's evidence: the chunks whose absence lowers the answer's likelihood most, found by
leaving each candidate out once: one forward a candidate over a copy of the cache without it
(asking_reference.leave_one_out, the slow reference), checked against removing the chunk from a
copy of the cache for real; and the candidates as rows of batched forwards that hide them by
the attention mask (asking.leave_one_out_batched, what questions use), checked against the
reference."""

import math

import pytest
import torch
from engine_helpers import TINY_FRAMES, assert_same_state, feed, frozen
from transformers import AutoModelForImageTextToText

from deltas_ros.core import asking
from deltas_ros.core.asking import by_drop, estimated_drops, leave_one_out_batched
from deltas_ros.core.asking_reference import estimated_drops_by_differences, leave_one_out
from deltas_ros.core.evidence_forward import (
    answer_log_probs,
    biased_log_prob,
    branch_mask,
    evidence_batch_bytes,
    evidence_rows,
)
from deltas_ros.core.kv_ops_reference import gather_cache
from deltas_ros.core.loader import LoadedModel
from deltas_ros.core.memory import MemoryConfig, StreamingMemory

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
        gather_cache(copy.backend, keep.nonzero().squeeze(1))
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
    """ask() reports the chunks leave_one_out_batched ranks first; with no candidates, the
    chunks the answer attended to most; either way the answer is the same and the memory
    bit-identical."""
    seen = []

    def recorded(*args):
        seen.append(leave_one_out_batched(*args))
        return seen[-1]

    monkeypatch.setattr(asking, "leave_one_out_batched", recorded)
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


def reference_drops(memory: StreamingMemory, ids: list[int], answer: list[int],
                    candidates: list[int], allowed: torch.Tensor | None) -> dict[int, float]:
    with torch.inference_mode():
        snapshot = memory.backend.snapshot()
        return leave_one_out(memory.backend, memory.slots, ids, answer, memory.next_position,
                             candidates, allowed, lambda: memory.backend.restore(snapshot),
                             math.inf)


def batch_bound(memory: StreamingMemory, rows: int, ids: list[int], answer: list[int]) -> int:
    """The batch bound at which `rows` rows fit in one forward of this question."""
    return evidence_batch_bytes(memory.model.config.text_config, rows, memory.kv_tokens,
                                len(ids) + len(answer), len(answer), memory.backend.dtype)


@pytest.mark.parametrize("rows", [1, 3, CHUNKS + 1])  # one row a forward, a few batches, one
@pytest.mark.parametrize("windowed", [False, True])
def test_batched_drops_equal_the_reference_and_leave_the_memory_as_it_was(memory, rows,
                                                                         windowed):
    """Each candidate hidden by the mask in a batch row drops log p(answer) as much as the
    reference's forward over a copy without it; a window hides the same slots in every row.
    The memory's cache is only read: bit-identical, with no restore."""
    ids = memory.layout.question_ids(memory.tokenizer, "What color was the ball?")
    answer = memory.tokenizer.encode(" a red ball", add_special_tokens=False)
    allowed = asking.window_slots(memory.slots, 1.0, 4.5) if windowed else None
    candidates = [4, 1, 3, 2] if windowed else list(range(CHUNKS))
    expected = reference_drops(memory, ids, answer, candidates, allowed)
    before = frozen(memory)
    with torch.inference_mode():
        drops = leave_one_out_batched(memory.backend, memory.slots, ids, answer,
                                      memory.next_position, candidates, allowed, math.inf,
                                      batch_bytes=batch_bound(memory, rows, ids, answer))
    assert_same_state(frozen(memory), before)
    assert list(drops) == candidates
    for c in candidates:
        assert drops[c] == pytest.approx(expected[c], abs=1e-4), c  # batched sums: fp32 order
    assert len({round(d, 4) for d in drops.values()}) > 1


def test_batched_drops_equal_the_reference_with_eager_attention(tiny_model_dir, tiny_model):
    """The mask is additive, so eager attention takes it as sdpa does."""
    model = AutoModelForImageTextToText.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True, attn_implementation="eager")
    model.eval().requires_grad_(False)
    eager = StreamingMemory(LoadedModel(model, tiny_model.tokenizer, tiny_model_dir,
                                        torch.device("cpu"), torch.float32, False), CONFIG)
    feed(eager, range(CHUNKS))
    ids = eager.layout.question_ids(eager.tokenizer, "Where was the ball?")
    answer = eager.tokenizer.encode(" on the left", add_special_tokens=False)
    expected = reference_drops(eager, ids, answer, list(range(CHUNKS)), None)
    with torch.inference_mode():
        drops = leave_one_out_batched(eager.backend, eager.slots, ids, answer,
                                      eager.next_position, list(range(CHUNKS)), None, math.inf)
    assert drops == pytest.approx(expected, abs=1e-4)  # batched sums: fp32 order


def test_batched_search_stops_between_batches(memory):
    asked = []

    def cancelled() -> bool:
        asked.append(True)
        return len(asked) > 2  # after two batches

    ids, answer = [1, 2], [3]
    with torch.inference_mode():
        assert leave_one_out_batched(memory.backend, memory.slots, ids, answer,
                                     memory.next_position, [4, 1, 2], None, 0.0) == {}
        drops = leave_one_out_batched(memory.backend, memory.slots, ids, answer,
                                      memory.next_position, [4, 1, 2, 0, 5], None, math.inf,
                                      cancelled, batch_bound(memory, 2, ids, answer))
    assert list(drops) == [4, 1, 2]  # rows: (nothing, 4), (1, 2); then cancelled
    assert by_drop([4, 1, 2, 0, 5], drops)[3:] == [0, 5]


def test_a_row_sees_the_unhidden_slots_and_only_its_own_tokens_causally():
    hidden = torch.tensor([[False, True, False], [True, False, False]])
    mask = branch_mask(hidden, 2, torch.float32)
    assert mask.shape == (1, 1, 2 * 2, 3 + 2 * 2)  # the rows' queries folded into one row
    seen = mask[0, 0] == 0
    assert seen.tolist() == [
        [True, False, True, True, False, False, False],
        [True, False, True, True, True, False, False],
        [False, True, True, False, False, True, False],
        [False, True, True, False, False, True, True],
    ]
    assert (mask[~(mask == 0)] == torch.finfo(torch.float32).min).all()


def test_the_batch_is_as_large_as_the_bound_allows(tiny_model):
    text = tiny_model.model.config.text_config
    sizes = [evidence_batch_bytes(text, rows, 8192, 40, 16, torch.bfloat16)
             for rows in range(1, 34)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert evidence_rows(sizes[9], text, 8192, 40, 16, torch.bfloat16, 33) == 10
    assert evidence_rows(sizes[9] - 1, text, 8192, 40, 16, torch.bfloat16, 33) == 9
    assert evidence_rows(sizes[-1] * 2, text, 8192, 40, 16, torch.bfloat16, 33) == 33
    assert evidence_rows(1, text, 8192, 40, 16, torch.bfloat16, 33) == 1  # always progress


@pytest.mark.parametrize("windowed", [False, True])
def test_the_drop_estimates_are_the_slopes_of_log_p_and_leave_the_memory_as_it_was(memory,
                                                                                 windowed):
    """One backward gives every chunk's d log p / d (a bias on its slots' attention logits):
    what central differences of two forwards a chunk give; a window leaves its outside out."""
    ids = memory.layout.question_ids(memory.tokenizer, "What color was the ball?")
    answer = memory.tokenizer.encode(" a red ball", add_special_tokens=False)
    allowed = asking.window_slots(memory.slots, 1.0, 4.5) if windowed else None
    before = frozen(memory)
    with torch.inference_mode():
        estimates = estimated_drops(memory.backend, memory.slots, ids, answer,
                                    memory.next_position, allowed)
        expected = estimated_drops_by_differences(memory.backend, memory.slots, ids, answer,
                                                  memory.next_position, allowed)
    assert_same_state(frozen(memory), before)
    assert list(estimates) == list(expected) == ([1, 2, 3, 4] if windowed else list(range(6)))
    scale = max(abs(v) for v in expected.values())
    for c in expected:
        assert estimates[c] == pytest.approx(expected[c], abs=3e-3 * scale), c
    assert len({round(v / scale, 3) for v in estimates.values()}) > 1  # the chunks do differ


def test_the_unbiased_log_prob_is_the_search_rows(memory):
    """`biased_log_prob` at bias 0 is the first row of the exact test's forward."""
    ids = memory.layout.question_ids(memory.tokenizer, "What color was the ball?")
    answer = memory.tokenizer.encode(" a red ball", add_special_tokens=False)
    hidden = torch.zeros(memory.kv_tokens, dtype=torch.bool)
    with torch.inference_mode():
        row = answer_log_probs(memory.backend, ids, answer, memory.next_position, hidden[None])
        alone = biased_log_prob(memory.backend, ids, answer, memory.next_position, hidden,
                                torch.zeros(memory.kv_tokens))
    assert float(alone) == pytest.approx(row[0], abs=1e-5)


def test_the_search_tests_the_candidates_estimated_first(tiny_model, monkeypatch):
    """With 2 candidates only the two chunks of largest estimated drop are tested; the rest
    follow in the estimates' order."""
    tested, estimated = [], []

    def recording_test(*args):
        tested.append(args[5])
        return leave_one_out_batched(*args)

    def recording_estimates(*args):
        estimated.append(estimated_drops(*args))
        return estimated[-1]

    monkeypatch.setattr(asking, "leave_one_out_batched", recording_test)
    monkeypatch.setattr(asking, "estimated_drops", recording_estimates)
    memory = StreamingMemory(tiny_model, MemoryConfig(
        budget_tokens=10_000, window_tokens=8, max_new_tokens=4, evidence_chunks=CHUNKS,
        evidence_candidates=2, **TINY_FRAMES))
    feed(memory, range(CHUNKS))
    before = frozen(memory)
    report = memory.ask("What color was the ball?")
    assert_same_state(frozen(memory), before)
    ranked = sorted(estimated[0], key=estimated[0].__getitem__, reverse=True)
    assert tested == [ranked[:2]]
    assert report.evidence_times[2:] == [c + 0.25 for c in ranked[2:]]
    assert sorted(report.evidence_times[:2]) == sorted(c + 0.25 for c in ranked[:2])


def test_an_estimate_beyond_its_bound_leaves_the_ranking_to_the_attention(tiny_model,
                                                                          monkeypatch):
    """A long answer's estimate would hold every layer's attention weights at once: past
    GATE_PASS_BYTES it is not run, and the candidates tested are those attended to most."""
    tested = []

    def recording_test(*args):
        tested.append(args[5])
        return leave_one_out_batched(*args)

    def no_estimate(*_):
        raise AssertionError("the estimate ran past its bound")

    monkeypatch.setattr(asking, "leave_one_out_batched", recording_test)
    monkeypatch.setattr(asking, "estimated_drops", no_estimate)
    monkeypatch.setattr(asking, "gate_pass_bytes", lambda *_: asking.GATE_PASS_BYTES + 1)
    reports = {}
    for candidates in (0, 2):
        memory = StreamingMemory(tiny_model, MemoryConfig(
            budget_tokens=10_000, window_tokens=8, max_new_tokens=4, evidence_chunks=CHUNKS,
            evidence_candidates=candidates, **TINY_FRAMES))
        feed(memory, range(CHUNKS))
        reports[candidates] = memory.ask("What color was the ball?")
    attended = [round(t - 0.25) for t in reports[0].evidence_times]
    assert tested == [attended[:2]]
    assert reports[2].evidence_times[2:] == reports[0].evidence_times[2:]
