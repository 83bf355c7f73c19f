"""The training scan of the chunked gated delta rule against transformers' (the reference)."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from deltas_ros.training.gated_delta import chunk_gated_delta_rule

REFERENCE = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)


def inputs(length: int, k_heads: int, v_heads: int, seed: int, state: bool):
    g = torch.Generator().manual_seed(seed)
    batch, k_dim, v_dim = 2, 8, 6
    tensors = [torch.randn(batch, length, k_heads, k_dim, generator=g),
               torch.randn(batch, length, k_heads, k_dim, generator=g),
               torch.randn(batch, length, v_heads, v_dim, generator=g),
               -torch.rand(batch, length, v_heads, generator=g) * 0.5,  # log decay <= 0
               torch.rand(batch, length, v_heads, generator=g)]
    initial = torch.randn(batch, v_heads, k_dim, v_dim, generator=g) if state else None
    return [t.requires_grad_() for t in tensors], initial


@pytest.mark.parametrize("length,k_heads,v_heads,state,l2norm", [
    (5, 2, 2, False, True),      # shorter than a chunk
    (64, 1, 2, True, True),      # exactly one chunk, grouped heads, a carried state
    (203, 2, 4, True, False),    # several chunks and padding
    (130, 2, 2, False, False),
])
def test_outputs_states_and_gradients_match_the_reference(length, k_heads, v_heads, state,
                                                          l2norm):
    """Same output and final state, and the same gradients for every input, within float32
    rounding, at a chunk size small enough for several chunks."""
    results = []
    for kernel in (REFERENCE, chunk_gated_delta_rule):
        tensors, initial = inputs(length, k_heads, v_heads, seed=length, state=state)
        out, final = kernel(*tensors, chunk_size=16, initial_state=initial,
                            output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        (out.square().sum() + final.sum()).backward()
        results.append((out, final, [t.grad for t in tensors]))
    (out, final, grads), (ours, our_final, our_grads) = results
    torch.testing.assert_close(ours, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_final, final, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(our_grads, grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_dtype_and_no_final_state_follow_the_reference():
    tensors, _ = inputs(20, 2, 2, seed=1, state=False)
    half = [t.detach().to(torch.bfloat16) for t in tensors]
    out, final = chunk_gated_delta_rule(*half)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 20, 2, 6) and final is None
