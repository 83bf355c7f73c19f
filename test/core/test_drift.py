"""State drift (Eq. 3): the engine's stacked path against hand computations and the
layer-by-layer reference."""

import math

import pytest
import torch
from engine_helpers import TINY_FRAMES, frames_for
from hypothesis import given, settings
from hypothesis import strategies as st

from deltas_ros.core.drift import drift_of_views, drift_views
from deltas_ros.core.drift_reference import state_drift_reference
from deltas_ros.core.memory import MemoryConfig, StreamingMemory


def state_drift(before: list[torch.Tensor], after: list[torch.Tensor]
                ) -> tuple[float, list[float]]:
    """The engine's drift of any states: laid out as backend._StateBuffers holds them (after in
    row 0, before in row 2, each layer's row zero-padded to the largest state, float32)."""
    work = torch.zeros(3, len(before), max(b.numel() for b in before))
    for row, a, b in zip(work.unbind(1), after, before):
        row[0, :a.numel()].copy_(a.reshape(-1))
        row[2, :b.numel()].copy_(b.reshape(-1))
    return drift_of_views(*drift_views(work))


def test_drift_equals_hand_computation():
    before = [torch.tensor([[3.0, 0.0], [0.0, 4.0]]), torch.ones(2, 2, 2)]
    after = [torch.tensor([[3.0, 1.0], [0.0, 4.0]]), torch.full((2, 2, 2), 3.0)]
    mean, per_layer = state_drift(before, after)
    # layer 0: ||diff|| = 1, ||before|| = 5; layer 1: ||2 * ones(8)|| / ||ones(8)|| = 2
    assert per_layer == pytest.approx([0.2, 2.0])
    assert mean == pytest.approx(1.1)


def test_drift_is_computed_in_float32():
    before = [torch.full((64, 64), 1.0, dtype=torch.bfloat16)]
    after = [torch.full((64, 64), 1.0078125, dtype=torch.bfloat16)]  # one bf16 ulp above 1
    _, (ratio,) = state_drift(before, after)
    assert ratio == pytest.approx(0.0078125, rel=1e-6)


def test_first_chunk_rule_zero_previous_state_counts_as_full_change():
    zero = torch.zeros(2, 3)
    mean, per_layer = state_drift([zero, zero], [torch.ones(2, 3), zero])
    assert per_layer == [1.0, 0.0]  # new content: 1.0; nothing before nor after: 0.0
    assert mean == 0.5
    assert all(math.isfinite(x) for x in per_layer)


def test_the_reference_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        state_drift_reference([torch.ones(2)], [])
    with pytest.raises(ValueError):
        state_drift_reference([torch.ones(2)], [torch.ones(3)])


def test_fast_drift_equals_the_layer_by_layer_reference():
    gen = torch.Generator().manual_seed(1)
    before = [torch.randn(1, 4, 16, 16, generator=gen) for _ in range(6)] + [torch.zeros(3, 3)]
    after = [b + 0.1 * torch.randn(b.shape, generator=gen) for b in before]
    fast_mean, fast = state_drift(before, after)
    ref_mean, ref = state_drift_reference(before, after)
    assert fast == pytest.approx(ref, rel=1e-6) and fast_mean == pytest.approx(ref_mean)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 5), shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)),
                                                 min_size=5, max_size=5),
       zero=st.lists(st.booleans(), min_size=5, max_size=5), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_engine_drift_equals_the_reference_for_any_shapes_zero_states_and_dtypes(
        layers, shapes, zero, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    before = [torch.zeros(shape, dtype=dtype) if zero[i]
              else torch.randn(shape, generator=gen).to(dtype)
              for i, shape in enumerate(shapes[:layers])]
    after = [b + torch.randn(b.shape, generator=gen).to(dtype) * (i % 2) for i, b in
             enumerate(before)]  # odd layers move, even ones stay
    mean, per_layer = state_drift(before, after)
    ref_mean, ref = state_drift_reference(before, after)
    assert per_layer == pytest.approx(ref, rel=1e-5, abs=1e-7)
    assert mean == pytest.approx(ref_mean, rel=1e-5, abs=1e-7)


def test_drift_views_reject_a_wrong_layout():
    with pytest.raises(ValueError):
        drift_views(torch.zeros(2, 2, 4))
    with pytest.raises(ValueError):
        drift_views(torch.zeros(3, 2, 4, dtype=torch.float64))


def test_engine_drift_from_its_snapshot_equals_the_reference(tiny_model):
    """The engine's path (snapshot into the stacked buffers, Backend.drift) on a real stream
    gives the per-layer reference's drift, chunk after chunk, while the buffers are reused."""
    memory = StreamingMemory(tiny_model, MemoryConfig(budget_tokens=80, window_tokens=20,
                                                      **TINY_FRAMES))
    backend = memory.backend
    with torch.inference_mode():
        for chunk in range(6):
            before = [s.clone() for s in backend.recurrent_states()]
            result = memory.add_chunk(frames_for(chunk), [chunk, chunk + 0.5])
            ref_mean, ref = state_drift_reference(before, backend.recurrent_states())
            assert result.layer_drift == pytest.approx(ref, rel=1e-5)
            assert result.drift == pytest.approx(ref_mean, rel=1e-5)
        assert result.drift > 0


def test_a_stale_snapshot_is_refused_and_a_current_one_restores(tiny_model):
    memory = StreamingMemory(tiny_model, MemoryConfig(**TINY_FRAMES))
    backend = memory.backend
    with torch.inference_mode():
        stale = backend.snapshot()
        current = backend.snapshot()
        with pytest.raises(RuntimeError, match="stale"):
            backend.restore(stale)
        with pytest.raises(RuntimeError, match="stale"):
            backend.drift(stale)
        live = backend.recurrent_states() + backend.conv_states()
        expected = [s.clone() for s in live]
        for state in live:
            state.add_(1.0)
        backend.restore(current)
        assert all(torch.equal(a, b) for a, b in zip(live, expected))
