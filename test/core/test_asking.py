"""Asking with a stream-time window, a per-token callback and cancellation; chunk poses kept
with the memory and returned for the evidence."""

import math

import pytest
import torch
from engine_helpers import (
    TINY_FRAMES,
    assert_same_state,
    feed,
    frames_for,
    frozen,
    next_logits,
    question_ids,
)

from deltas_ros.core.asking import window_slots
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.poses import Pose

ASK_CONFIG = dict(budget_tokens=10_000, window_tokens=8, max_new_tokens=6, **TINY_FRAMES)


@pytest.fixture(scope="module")
def memory(tiny_model) -> StreamingMemory:
    """10 chunks at stream times c + 0.25, each with a pose at x = c."""
    memory = StreamingMemory(tiny_model, MemoryConfig(**ASK_CONFIG))
    for c in range(10):
        memory.add_chunk(frames_for(c), [c, c + 0.5], stamp=1000.0 + c, pose=pose_at(c))
    return memory


def pose_at(c: float) -> Pose:
    return Pose.checked("map", (float(c), 0.0, 0.0), (0, 0, math.sin(c / 4), math.cos(c / 4)))


@torch.inference_mode()
def test_window_sees_what_masking_the_other_slots_sees(memory):
    allowed = window_slots(memory.slots, 3.0, 5.5)
    total = memory.kv_tokens
    query_len = question_ids(memory, "what is on the table?")[0].shape[1]
    visible = torch.cat([allowed.expand(query_len, -1),
                         torch.ones(query_len, query_len).tril().bool()], dim=1)
    mask = torch.zeros(1, 1, query_len, total + query_len)
    mask[..., ~visible] = torch.finfo(torch.float32).min
    before, snapshot = frozen(memory), memory.backend.snapshot()
    masked = next_logits(memory, {"full_attention": mask, "linear_attention": None})
    memory.backend.restore(snapshot)
    with memory.backend.visible_slots(allowed.nonzero().squeeze(1)):
        windowed = next_logits(memory)
    assert memory.kv_tokens == total  # the originals are back, untouched
    memory.backend.restore(snapshot)
    torch.testing.assert_close(windowed, masked, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(windowed, next_logits(memory))  # the window changes the answer
    memory.backend.restore(snapshot)
    assert_same_state(frozen(memory), before)


def test_windowed_evidence_comes_only_from_the_window(memory):
    before = frozen(memory)
    answer = memory.ask("Where was the red ball?", since=3.0, until=5.5)
    assert sorted(answer.evidence_times) == [3.25, 4.25, 5.25]
    assert sorted(answer.evidence_stamps) == [1003.0, 1004.0, 1005.0]
    open_ended = memory.ask("Where was the red ball?", since=8.0)
    assert sorted(open_ended.evidence_times) == [8.25, 9.25]
    assert_same_state(frozen(memory), before)


@pytest.mark.parametrize("since, until, problem", [(5.0, 3.0, "after its until"),
                                                   (20.0, None, "no retained chunk"),
                                                   (math.nan, None, "finite")])
def test_bad_windows_are_refused_changing_nothing(memory, since, until, problem):
    before = frozen(memory)
    with pytest.raises(ValueError, match=problem):
        memory.ask("What is on the table?", since=since, until=until)
    assert_same_state(frozen(memory), before)


def test_tokens_stream_and_cancel_stops_within_one_token(memory):
    before = frozen(memory)
    streamed: list[tuple[str, int]] = []
    full = memory.ask("What is on the table?", max_new_tokens=6,
                      on_token=lambda text, n, _reasoning: streamed.append((text, n)))
    assert [n for _, n in streamed] == list(range(1, full.generated_tokens + 1))
    assert streamed[-1][0] == full.text and not full.cancelled
    assert full.generated_tokens >= 3  # a random model rarely ends its turn at once

    seen: list[int] = []
    cancelled = memory.ask("What is on the table?", max_new_tokens=6,
                           on_token=lambda text, n, _reasoning: seen.append(n),
                           cancelled=lambda: len(seen) >= 2)
    assert cancelled.cancelled and cancelled.generated_tokens == 2 and seen == [1, 2]
    assert full.text.startswith(cancelled.text)
    assert_same_state(frozen(memory), before)


def test_a_failing_callback_rolls_the_question_back(memory):
    before = frozen(memory)

    def explode(text: str, n: int, reasoning: str) -> None:
        raise RuntimeError("subscriber went away")

    with pytest.raises(Exception, match="subscriber went away"):
        memory.ask("What is on the table?", on_token=explode)
    assert_same_state(frozen(memory), before)
    assert memory.ask("What is on the table?", max_new_tokens=2).generated_tokens <= 2


def test_evidence_poses_are_the_chunk_poses(memory):
    answer = memory.ask("Where was the red ball?")
    assert len(answer.evidence_poses) == len(answer.evidence_times) == 3
    for time_s, pose in zip(answer.evidence_times, answer.evidence_poses):
        assert pose == pose_at(time_s - 0.25)


def test_poses_follow_eviction(tiny_model):
    # DeltaS drops chunks whole: some of the 12 and their poses are surely gone.
    memory = StreamingMemory(tiny_model, MemoryConfig(budget_tokens=120, window_tokens=40,
                                                      policy="deltas", **TINY_FRAMES))
    results = [memory.add_chunk(frames_for(c), [c, c + 0.5], stamp=1000.0 + c,
                                pose=None if c == 3 else pose_at(c)) for c in range(12)]
    assert results[5].pose == pose_at(5) and results[3].pose is None
    held = memory.slots.retained_chunks()
    assert len(held) < 12 and sorted(memory.slots.poses) == held
    assert all(memory.slots.pose(c) == (None if c == 3 else pose_at(c)) for c in held)
    feed(memory, range(12, 13))  # a chunk without a pose
    assert memory.slots.pose(12) is None
