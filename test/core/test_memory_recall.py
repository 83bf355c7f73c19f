"""The second tier through StreamingMemory: what an eviction lets go is tiered as it was cached,
a question calls it back into its own view only, and the memory is bitwise as before."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import assert_same_state, feed, frozen

from deltas_ros.core.asking import recall_chunks, text_positions
from deltas_ros.core.config import MemoryConfig
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.core.tiers import DISK

# recency: whole chunks leave oldest first, so which chunk is tiered when is known.
SMALL = dict(budget_tokens=40, sink_tokens=4, window_tokens=8, buckets=1, policy="recency",
             pixel_budget=64 * 64, evidence_candidates=0, max_new_tokens=4)
QUESTION = "What did you see?"


@pytest.fixture
def tiered(tiny_model):
    """Memories with a second tier; their writer threads end with the test, so no later fork
    (the chat template's bounded render) happens beside one at work."""
    made: list[StreamingMemory] = []

    def make(**fields) -> StreamingMemory:
        made.append(StreamingMemory(tiny_model, MemoryConfig(
            **{**SMALL, "host_budget_mb": 64.0, "recall_tokens": 64, **fields})))
        return made[-1]

    yield make
    for memory in made:
        memory.close()


def test_evicted_slots_are_tiered_as_they_were_cached(tiered):
    memory = tiered()
    feed(memory, range(1))
    first = memory.slots.chunk == 0
    keys = [t[0][:, first] for t in memory.backend.newest(len(memory.slots))[0]]
    fed = sum(r.chunk_tokens for r in feed(memory, range(1, 8))) + int(first.sum())
    assert memory.tiers.flush(10.0)
    index = memory.tiers.index()
    assert 0 in index.chunks
    piece = memory.tiers.load([0])[0]
    torch.testing.assert_close(piece.keys, torch.stack(keys), rtol=0, atol=0)
    assert piece.stamp == 1000.0 and piece.time_s == 0.25  # a chunk's time: its frames' mean
    held = memory.slots.chunk >= 0  # a chunk may be part held, part tiered: no slot is lost
    assert int(held.sum()) + int(index.tokens.sum()) == fed
    assert set(memory.slots.chunk[held].tolist()) | set(index.chunks) == set(range(8))


def test_an_evicted_chunk_is_listed_at_once_in_the_tier(tiered):
    memory = tiered()
    fed = sum(r.chunk_tokens for r in feed(memory, range(8)))
    stats = memory.stats()  # no flush: the writer may not have placed the last eviction yet
    held = int((memory.slots.chunk >= 0).sum())
    assert held + sum(c.tokens for c in stats.tiered) == fed
    assert memory.tiers.flush(10.0)
    assert memory.stats().tiered == stats.tiered


def test_a_question_calls_back_tiered_chunks_and_leaves_the_memory_bitwise(tiered):
    memory = tiered()
    feed(memory, range(8))
    assert memory.tiers.flush(10.0)
    before, tiers_before = frozen(memory), memory.tiers.index().chunks
    oldest_held = float(memory.slots.time[memory.slots.chunk >= 0].min())
    told: list[tuple[int, int]] = []
    answer = memory.ask(QUESTION, on_recall=lambda n, disk: told.append((n, disk)))
    assert answer.recalled_chunks >= 1 and answer.recalled_from_disk == 0
    assert told == [(answer.recalled_chunks, 0)]
    tiered_times = {c.time for c in memory.stats().tiered}
    assert len(answer.recalled_times) == answer.recalled_chunks
    assert set(answer.recalled_times) <= tiered_times
    assert answer.span_start < oldest_held  # the question saw a tiered chunk
    assert_same_state(frozen(memory), before)
    assert memory.tiers.index().chunks == tiers_before
    assert replace(memory.ask(QUESTION), latency_ms=0) == replace(answer, latency_ms=0)


def test_recall_off_answers_as_without_a_second_tier(tiny_model, tiered):
    plain = StreamingMemory(tiny_model, MemoryConfig(**SMALL))
    off = tiered(recall_tokens=0)
    feed(plain, range(8))
    feed(off, range(8))
    a, b = plain.ask(QUESTION), off.ask(QUESTION)
    assert (a.text, a.evidence_times, b.recalled_chunks) == (b.text, b.evidence_times, 0)


def test_a_window_the_gpu_tier_no_longer_holds_recalls_from_the_tiers(tiny_model, tiered):
    memory = tiered()
    feed(memory, range(8))
    assert memory.tiers.flush(10.0)
    held = memory.slots.time[memory.slots.chunk >= 0]
    assert float(held.min()) > 1.0  # chunks 0 and 1 are tiered only
    answer = memory.ask(QUESTION, since=0.0, until=1.0)
    assert answer.recalled_chunks >= 1
    assert answer.evidence_times and all(0.0 <= t <= 1.0 for t in answer.evidence_times)
    plain = StreamingMemory(tiny_model, MemoryConfig(**SMALL))
    feed(plain, range(8))
    with pytest.raises(ValueError, match="no retained chunk"):
        plain.ask(QUESTION, since=0.0, until=1.0)


def test_recall_reads_the_disk_tier(tiered, tmp_path):
    memory = tiered(host_budget_mb=0.0, disk_budget_mb=64.0,
                    tier_dir=str(tmp_path / "tiers"))
    feed(memory, range(8))
    assert memory.tiers.flush(10.0)
    assert set(memory.tiers.index().tiers) == {DISK}
    answer = memory.ask(QUESTION)
    assert answer.recalled_chunks == answer.recalled_from_disk >= 1


def test_reset_clears_the_tiers(tiered):
    memory = tiered()
    feed(memory, range(8))
    assert memory.tiers.flush(10.0) and memory.tiers.index().chunks
    memory.reset()
    assert memory.tiers.index().chunks == []


def test_second_tier_settings_are_checked():
    with pytest.raises(ValueError, match="tier_dir"):
        MemoryConfig(disk_budget_mb=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        MemoryConfig(recall_tokens=-1)


@torch.inference_mode()
def test_the_first_layer_queries_are_the_prefills_whatever_the_view_holds(tiered):
    memory = tiered()
    feed(memory, range(8))
    backend, before = memory.backend, frozen(memory)
    ids = memory.layout.question_ids(memory.tokenizer, QUESTION)
    text, positions = torch.tensor([ids]), text_positions(memory.next_position, len(ids))
    first = backend.first_queries(text, positions)
    assert_same_state(frozen(memory), before)
    prefix_only = memory.slots.chunk < 0
    for visible in (None, prefix_only.nonzero().squeeze(1)):
        with backend.undone(), backend.visible_slots(visible), backend.question_queries() as q:
            backend.prefill_text(text, positions)
        assert first.shape == q[0].shape == (backend.model.config.text_config
                                             .num_attention_heads, len(ids), first.shape[-1])
        torch.testing.assert_close(first, q[0], rtol=0, atol=0)
        assert not torch.equal(q[1], q[0])  # the deeper layer's queries did read the view


def test_every_layers_queries_need_every_layers_summaries(tiered):
    memory = tiered()
    feed(memory, range(8))
    assert memory.tiers.flush(10.0)
    ids = memory.layout.question_ids(memory.tokenizer, QUESTION)
    with pytest.raises(ValueError, match="every layer's key summaries"):
        recall_chunks(memory.backend, memory.tiers.index(), ids, memory.next_position, None,
                      None, None, 64, every_layer=True)
