"""State drift (Eq. 3) and the beta*||e|| write strength against hand computations."""

import inspect
import math

import pytest
import torch
from engine_helpers import TINY_FRAMES, frames_for
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5 import modeling_qwen3_5

from deltas_ros.core.drift import stacked_drift, state_drift, write_strength
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.reference import state_drift_reference


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


def test_drift_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        state_drift([torch.ones(2)], [])
    with pytest.raises(ValueError):
        state_drift([torch.ones(2)], [torch.ones(3)])


def test_write_strength_single_token_by_hand():
    # One head, dk = dv = 2: S0 = I, alpha = 0.5, beta = 0.25, k = e1, v = (3, 1).
    state = torch.eye(2).view(1, 1, 2, 2)
    key = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    value = torch.tensor([3.0, 1.0]).view(1, 1, 1, 2)
    g = torch.tensor(math.log(0.5)).view(1, 1, 1)
    beta = torch.tensor(0.25).view(1, 1, 1)
    # residual = v - alpha * S0^T k = (3, 1) - 0.5 * (1, 0) = (2.5, 1)
    expected = 0.25 * math.hypot(2.5, 1.0)
    got = write_strength(key, value, g, beta, state, normalize_keys=False)
    assert got.shape == (1, 1)
    assert got.item() == pytest.approx(expected)


def test_write_strength_replays_the_same_recurrence_as_transformers():
    """The state our replay builds is the one transformers' reference recurrence builds."""
    gen = torch.Generator().manual_seed(0)
    b, n, hk, hv, d = 1, 7, 2, 4, 8
    key = torch.randn(b, n, hk, d, generator=gen)
    value = torch.randn(b, n, hv, d, generator=gen)
    g = -torch.rand(b, n, hv, generator=gen)
    beta = torch.rand(b, n, hv, generator=gen)
    init = torch.randn(b, hv, d, d, generator=gen)
    strength_all = write_strength(key, value, g, beta, init)
    # Replaying the first 3 tokens with transformers, then the rest from its state, must give
    # the same strengths for the rest as replaying all at once.
    # The pure-torch reference (the module binding may be fla's Triton kernel, GPU only).
    reference = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
    _, mid = reference(
        torch.zeros_like(key[:, :3]), key[:, :3], value[:, :3], g=g[:, :3], beta=beta[:, :3],
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    strength_rest = write_strength(key[:, 3:], value[:, 3:], g[:, 3:], beta[:, 3:], mid)
    torch.testing.assert_close(strength_rest, strength_all[:, 3:], rtol=1e-5, atol=1e-5)


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
def test_stacked_drift_equals_the_reference_for_any_shapes_zero_states_and_dtypes(
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


def test_stacked_drift_rejects_a_wrong_layout():
    with pytest.raises(ValueError):
        stacked_drift(torch.zeros(2, 2, 4))
    with pytest.raises(ValueError):
        stacked_drift(torch.zeros(3, 2, 4, dtype=torch.float64))


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
