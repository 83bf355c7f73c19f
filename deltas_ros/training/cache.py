"""The training forward's cache: one stream prefill shared by several questions.

Training needs what inference never does: gradients back through the cache into the stream,
so the linear-attention layers must replace their states instead of copying into fixed
buffers. That surgery on transformers' cache layers lives here, apart from the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache


def repeat_cache(cache: DynamicCache, repeats: int, text_config) -> DynamicCache:
    """A new cache holding each batch row of `cache` `repeats` times (rows b*repeats + q), so
    one stream prefill serves several questions in training.

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
        if getattr(old, "keys", None) is not None:
            new.lazy_initialization(old.keys, old.values)
            new.keys = old.keys.repeat_interleave(repeats, 0)
            new.values = old.values.repeat_interleave(repeats, 0)
    return out


def _assigning_update(layer) -> Callable[..., torch.Tensor]:
    def update(recurrent_states: torch.Tensor, state_idx: int = 0, **_) -> torch.Tensor:
        layer.recurrent_states[state_idx] = recurrent_states
        return recurrent_states
    return update
