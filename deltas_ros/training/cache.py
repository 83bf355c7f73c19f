"""The training forward's cache: one stream prefill shared by several questions.

Training needs what inference never does: gradients back through the cache into the stream,
so the linear-attention layers must replace their states instead of copying into fixed
buffers. That surgery on transformers' cache layers lives here, apart from the engine.

Two ways to ask Q questions of one prefill, the same logits (test_cache.py):
- `repeat_cache` (the reference): every layer's cache repeated Q times. Simple, but each
  question's full-attention layers copy and attend over their own copy of the stream's K/V:
  half of a 30-minute step went to those copies.
- `sharing_the_stream` (what training runs): the linear-attention states are repeated (they
  are small), the stream's K/V are not. Each full-attention layer puts a stream's Q questions
  in one row (`shared_stream_attention`), a block mask keeping each question to the stream
  and its own earlier tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache

SHARED_STREAM = "deltas_shared_stream"  # the attention implementation's registered name

# layer index -> the stream's keys and values (B, H_kv, N, D), during a question pass
_STREAM_KV: ContextVar[dict[int, tuple[torch.Tensor, torch.Tensor]]] = ContextVar(
    "deltas_stream_kv")


def repeat_cache(cache: DynamicCache, repeats: int, text_config,
                 full_attention: bool = True) -> DynamicCache:
    """A new cache holding each batch row of `cache` `repeats` times (rows b*repeats + q), so
    one stream prefill serves several questions in training (full_attention=False: the
    linear-attention layers only, for `sharing_the_stream`).

    Its Gated DeltaNet layers replace their states instead of updating them in place, so
    gradients flow back through the questions into the stream (transformers' cache copies
    into fixed buffers for cudagraphs, which autograd cannot go back through).
    """
    out = DynamicCache(config=text_config)
    for old, new in zip(cache.layers, out.layers):
        if hasattr(old, "recurrent_states"):
            new.conv_states[0] = old.conv_states[0].repeat_interleave(repeats, 0)
            new.recurrent_states[0] = old.recurrent_states[0].repeat_interleave(repeats, 0)
            new.conv_kernel_size[0] = old.conv_kernel_size[0]
            new.dtype, new.device = old.dtype, old.device
            new.is_conv_states_initialized[0] = new.is_recurrent_states_initialized[0] = True
            new.has_previous_state[0] = True
            new.record_past = True  # conv states: assigned, not copied in place
            new.update_recurrent_state = _assigning_update(new)
        if full_attention and getattr(old, "keys", None) is not None:
            new.lazy_initialization(old.keys, old.values)
            new.keys = old.keys.repeat_interleave(repeats, 0)
            new.values = old.values.repeat_interleave(repeats, 0)
    return out


def _assigning_update(layer) -> Callable[..., torch.Tensor]:
    def update(recurrent_states: torch.Tensor, state_idx: int = 0, **_) -> torch.Tensor:
        layer.recurrent_states[state_idx] = recurrent_states
        return recurrent_states
    return update


def shared_stream_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor,
                            scaling: float | None = None, dropout: float = 0.0,
                            **_: object) -> tuple[torch.Tensor, None]:
    """query (B*Q, H, L, D); key, value (B*Q, H_kv, L, D): the questions' own tokens, Q per
    stream; attention_mask (1, 1, Q*L, N + Q*L) from `questions_mask` -> (B*Q, L, H, D), as
    transformers' attention functions return. The stream's K/V are read once per stream."""
    stream_keys, stream_values = _STREAM_KV.get()[module.layer_idx]
    streams = stream_keys.shape[0]
    rows, heads, length, dim = query.shape
    questions = rows // streams

    def one_row(x: torch.Tensor) -> torch.Tensor:  # (B*Q, h, L, D) -> (B, h, Q*L, D)
        x = x.reshape(streams, questions, x.shape[1], length, dim).transpose(1, 2)
        return x.reshape(streams, x.shape[1], questions * length, dim)

    out = F.scaled_dot_product_attention(
        one_row(query), torch.cat([stream_keys, one_row(key)], 2),
        torch.cat([stream_values, one_row(value)], 2), attn_mask=attention_mask,
        dropout_p=dropout, scale=scaling, enable_gqa=True)
    out = out.reshape(streams, heads, questions, length, dim).permute(0, 2, 3, 1, 4)
    return out.reshape(rows, length, heads, dim), None


AttentionInterface.register(SHARED_STREAM, shared_stream_attention)


def questions_mask(stream_tokens: int, questions: int, length: int,
                   device: torch.device) -> torch.Tensor:
    """(1, 1, Q*L, N + Q*L) bool: question q's token t sees the whole stream and tokens
    0..t of question q."""
    index = torch.arange(questions * length, device=device)
    own = (index[:, None] // length == index[None, :] // length) & (index[:, None] >= index)
    stream = torch.ones(questions * length, stream_tokens, dtype=torch.bool, device=device)
    return torch.cat([stream, own], 1)[None, None]


class _QuestionsOwnKeys:
    """A full-attention layer's cache in a question pass: the questions' K/V pass through,
    the stream's are read by `shared_stream_attention`."""

    def update(self, keys: torch.Tensor, values: torch.Tensor, *_: object,
               **__: object) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values


@contextmanager
def sharing_the_stream(model: torch.nn.Module, cache: DynamicCache, repeats: int, length: int,
                       ) -> Iterator[tuple[DynamicCache, dict[str, torch.Tensor | None]]]:
    """For a question pass of `repeats` questions of `length` tokens per stream row of
    `cache` (a stream's prefill): (the pass's cache, its attention masks by layer type), with
    the model's full-attention layers on `shared_stream_attention` until the block ends. Give
    the pass the masks as `attention_mask` and explicit positions (neither is derived)."""
    text_config = model.config.text_config
    questions = repeat_cache(cache, repeats, text_config, full_attention=False)
    stream = {}
    for index, old in enumerate(cache.layers):
        if getattr(old, "keys", None) is not None:
            stream[index] = (old.keys, old.values)
            questions.layers[index] = _QuestionsOwnKeys()
    keys = next(iter(stream.values()))[0]
    mask = questions_mask(keys.shape[2], repeats, length, keys.device)
    implementation = text_config._attn_implementation
    token = _STREAM_KV.set(stream)
    text_config._attn_implementation = SHARED_STREAM
    try:
        yield questions, {"full_attention": mask, "linear_attention": None}
    finally:
        text_config._attn_implementation = implementation
        _STREAM_KV.reset(token)
