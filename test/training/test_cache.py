"""A question pass sharing the stream's K/V against the reference, every question's own copy."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from deltas_ros.core.chunks import ChunkBuilder
from deltas_ros.core.kernels import select_gated_delta_kernels
from deltas_ros.core.prompt import ChatLayout
from deltas_ros.training.cache import questions_mask, sharing_the_stream
from deltas_ros.training.config import Stage, TrainConfig, VisionPretrain
from deltas_ros.training.gated_delta import chunk_gated_delta_rule
from deltas_ros.training.samples import forward, loss_and_hits, make_batch
from deltas_ros.training.train import new_model, scene_tokenizer

TINY = TrainConfig(batch=2, questions=3, width=64, height=48, pixel_budget=4096,
                   stages=[Stage(10**9, seconds=(2, 4))],
                   vision_pretrain=VisionPretrain(steps=0, batch=2))


@pytest.fixture(scope="module")
def trained_parts():
    torch.manual_seed(0)
    tokenizer = scene_tokenizer()
    model = new_model(TINY, tokenizer)
    select_gated_delta_kernels(model, torch.device("cpu"), chunk_gated_delta_rule)
    builder = ChunkBuilder.for_model(model, tokenizer, TINY.pixel_budget)
    return model, builder, ChatLayout.from_tokenizer(tokenizer)


def test_questions_see_the_stream_and_their_own_earlier_tokens():
    mask = questions_mask(stream_tokens=2, questions=2, length=3, device=torch.device("cpu"))
    assert mask.shape == (1, 1, 6, 2 + 6)
    expected = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 1, 0, 0, 0],
                             [1, 1, 0, 0, 0, 1, 0, 0],
                             [1, 1, 0, 0, 0, 1, 1, 0],
                             [1, 1, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("seconds", [2, 4])
def test_sharing_the_stream_gives_the_references_logits_and_gradients(trained_parts, seconds):
    """Two streams of three questions (answers of different lengths, so padded): the same
    logits, loss and gradients as every question attending over its own copy of the cache."""
    model, builder, layout = trained_parts
    batch = make_batch(builder, layout, TINY, [11, 12], seconds, TINY.stages[0].scenes, 3)
    results = []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        logits = forward(model, batch, torch.device("cpu"), shared)
        loss, hits = loss_and_hits(logits, batch)
        loss.backward()
        results.append((logits.detach(), loss.item(), hits,
                        [p.grad for p in model.parameters() if p.grad is not None]))
    (logits, loss, hits, grads), (ours, our_loss, our_hits, our_grads) = results
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)
    assert our_loss == pytest.approx(loss, rel=1e-5) and our_hits == hits
    assert len(our_grads) == len(grads)
    for mine, theirs in zip(our_grads, grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-5)
    assert model.config.text_config._attn_implementation == "sdpa"


def test_the_attention_implementation_comes_back_after_a_failure(trained_parts):
    model = trained_parts[0]
    config = model.config.text_config
    before = config._attn_implementation
    cache = DynamicCache(config=config)
    ids = torch.tensor([[1, 2, 3]])
    model.model(input_ids=ids, position_ids=torch.arange(3).expand(3, 1, -1), cache=cache,
                use_cache=True)
    with pytest.raises(RuntimeError, match="inside"):
        with sharing_the_stream(model, cache, 2, 4):
            assert config._attn_implementation != before
            raise RuntimeError("inside")
    assert config._attn_implementation == before
