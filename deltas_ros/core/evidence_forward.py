"""The evidence search's batched forward: many candidates as rows of one forward over the
stream's cache as it is, each hiding its slots by the attention mask, with no K/V copy.

`answer_log_probs` runs it (through `Backend.prefill_rows`); `evidence_batch_bytes` sizes it,
for the search's batches and for the memory plan. `gate_gradients` runs one row of it with a
backward, to rank the candidates before any is tested (`gate_pass_bytes` sizes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .backend import Backend

# Bytes one batched evidence forward may hold at its peak (`evidence_rows`): about one copy of
# the K/V at 9B and M = 8192 in bf16, what a search that copies the cache holds per candidate.
EVIDENCE_BATCH_BYTES = 512 << 20
# Bytes the drop estimate (`gate_gradients`) may hold at its peak (`gate_pass_bytes`): a 9B
# model's at M = 8192 with a 64-token question and a 64-token answer (4.0 GiB) fits. A longer
# answer keeps every layer's attention weights for the backward, which grow with its length:
# beyond this the candidates are ranked by attention mass instead.
GATE_PASS_BYTES = 5 << 30


def answer_log_probs(backend: Backend, ids: list[int], answer: list[int], position: int,
                     hidden: torch.Tensor) -> list[float]:
    """log p(answer | question `ids`, the cache without the slots hidden[b]) for each row b
    of hidden (B, T) bool: one teacher-forced forward of batch B of the question and the
    answer at `position`, over the backend's cache as it is (`BranchCache`: no K/V copy per
    row, the cache only read). The full-attention layers see the rows as one row of B*L queries
    (`Backend.folded_attention`), which `branch_mask` keeps each on its own tokens and off its
    hidden slots: one batch-1 attention over the cache, not B over broadcast copies of it.
    """
    rows, length, device = hidden.shape[0], len(ids) + len(answer), backend.device
    tokens = torch.tensor([ids + answer], device=device).expand(rows, -1)
    positions = torch.arange(position, position + length, device=device).expand(3, rows, -1)
    mask = branch_mask(hidden.to(device), length, backend.dtype)
    cache = BranchCache(backend.cache, rows, backend.model.config.text_config)
    states = backend.prefill_rows(tokens, positions, mask, cache)[:, len(ids) - 1:-1]
    return [backend.log_prob(states[row:row + 1], answer) for row in range(rows)]



def gate_gradients(backend: Backend, ids: list[int], answer: list[int], position: int,
                   hidden: torch.Tensor) -> torch.Tensor:
    """(T,) float32: d `biased_log_prob` / d bias at bias = 0 (0 at the slots hidden (T,) bool).

    Why: hiding a chunk is bias = -inf on its slots, i.e. scaling their attention weights by a
    gate g = e^bias from 1 to 0, so the sum of its slots' gradients is the first-order estimate
    of its leave-one-out drop, for every chunk at once: one forward and one backward, where the
    exact drops take a forward row each. The cache is only read and never saved for the
    backward (its K/V enter by concatenation, its recurrent states as copies), so an
    inference-mode cache serves.
    """
    with torch.inference_mode(False), torch.enable_grad():
        bias = torch.zeros(hidden.shape[0], device=backend.device, requires_grad=True)
        log_prob = biased_log_prob(backend, ids, answer, position, hidden, bias)
        (gradient,) = torch.autograd.grad(log_prob, bias)
    return gradient.float().cpu()


def biased_log_prob(backend: Backend, ids: list[int], answer: list[int], position: int,
                    hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """log p(answer | question `ids`, the cache without the slots hidden (T,) bool, each slot's
    attention logits at every full-attention layer raised by bias (T,)), as a 0-d tensor
    differentiable in `bias`: one row of `answer_log_probs`' forward, its mask plus the bias."""
    length, device = len(ids) + len(answer), backend.device
    mask = branch_mask(hidden[None].to(device), length, backend.dtype)
    mask = mask + F.pad(bias.to(device), (0, length)).to(backend.dtype)
    tokens = torch.tensor([ids + answer], device=device)
    positions = torch.arange(position, position + length, device=device).expand(3, 1, -1)
    cache = BranchCache(backend.cache, 1, backend.model.config.text_config)
    states = backend.prefill_rows(tokens, positions, mask, cache)[:, len(ids) - 1:-1]
    return backend.log_prob_tensor(states, answer)


class BranchCache(DynamicCache):
    """The cache of one forward of `rows` batch rows that each continue `source` (a stream's
    cache, batch 1) without writing into it: what lets the evidence search test many candidates
    in one forward, with no copy of the K/V per candidate.

    Full-attention layers (under `Backend.folded_attention`): the source's K/V (1, kv_heads, T,
    head_dim) by reference, then the rows' new K/V, which arrive folded into one row (row b's
    token j at slot T + b*L + j): one concatenation per layer for all rows; `branch_mask`
    keeps each row on its own tokens. Linear-attention layers: each row starts from the
    source's states (the recurrent state copied to the rows of one layer at a time, as fla's
    kernels read their rows contiguous), in the prefill branch (never the single-token one,
    which writes the conv state in place). Nothing is stored: each layer's concatenation and
    final states are freed after the layer.
    """

    def __init__(self, source: DynamicCache, rows: int, text_config) -> None:
        super().__init__(config=text_config)
        self.source, self.rows = source, rows

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        state = self.source.layers[layer_idx].conv_states[state_idx]
        return state.expand(self.rows, *state.shape[1:])

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        state = self.source.layers[layer_idx].recurrent_states[state_idx]
        # Always a copy: rows = 1 would hand out the stream's own (inference) tensor, which a
        # gradient pass (`gate_gradients`) may not save for its backward.
        return state.expand(self.rows, *state.shape[1:]).clone(
            memory_format=torch.contiguous_format)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **_) -> torch.Tensor:
        return torch.cat([self.get_conv_state(layer_idx, state_idx), conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **_) -> torch.Tensor:
        return recurrent_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *_, **__) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.source.layers[layer_idx]
        return (torch.cat([layer.keys, key_states], dim=-2),
                torch.cat([layer.values, value_states], dim=-2))


def branch_mask(hidden: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, B*L, T + B*L) additive attention mask of a `BranchCache` forward of L tokens a
    row, folded (`Backend.folded_attention`): query b*L + i (row b's token i) sees the cache
    slots not in hidden[b] (hidden (B, T) bool) and its own row's new tokens up to itself
    (slots T + b*L .. T + b*L + i), never another row's. The dtype's lowest value where hidden,
    as transformers' own masks, so that eager and sdpa attention both take it."""
    rows, device = hidden.shape[0], hidden.device
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    own = (torch.eye(rows, dtype=torch.bool, device=device)[:, None, :, None]
           & causal[None, :, None, :]).reshape(rows, tokens, rows * tokens)
    seen = torch.cat([(~hidden)[:, None, :].expand(-1, tokens, -1), own], dim=-1)
    mask = torch.zeros(seen.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min).view(1, 1, rows * tokens, -1)


def evidence_batch_bytes(text_config, rows: int, slots: int, tokens: int, answer: int,
                         dtype: torch.dtype) -> int:
    """An upper estimate of the bytes `answer_log_probs` holds at its peak beyond the
    model and the memory, for `rows` rows of `tokens` tokens (the last `answer` scored) over
    `slots` cache slots: what `evidence_rows` sizes a batch by and what a memory plan counts.

    The mask and the hidden states (with the MLP's) live through the forward; one layer's work
    at a time on top (`full_layer_bytes` or `linear_layer_bytes`). Then one row's answer logits
    and their log-softmax in float32.
    """
    text, size = text_config, torch.finfo(dtype).bits // 8
    queries, keys = rows * tokens, slots + rows * tokens
    hidden = queries * (keys + 4 * text.hidden_size + 3 * text.intermediate_size) * size
    return (hidden + max(full_layer_bytes(text, queries, keys, size),
                         linear_layer_bytes(text, rows, tokens, size))
            + 2 * answer * text.vocab_size * 4)


def gate_pass_bytes(text_config, slots: int, tokens: int, answer: int, dtype: torch.dtype,
                    device_type: str) -> int:
    """An upper estimate of the bytes `gate_gradients` holds at its peak beyond the model and
    the memory, for `tokens` tokens (the last `answer` scored) over `slots` cache slots on a
    `device_type` device: what a memory plan counts for it beside the exact test's batches
    (they never overlap).

    Its forward is one row of `answer_log_probs`', but keeps for the backward what each layer
    needs, every layer at once (`full_layer_bytes`, `linear_layer_bytes`), with the mask, the
    hidden states and the MLP's of every layer, and the answer's logits; the backward holds one
    layer's gradients of the same size on top. On the CPU what it keeps is float32 whatever the
    dtype (the math attention upcasts its K/V, the norms their input), so there every term
    counts 4 bytes an element: bfloat16 measured about as much as float32 (docs/robot.md).
    """
    text = text_config
    size = 4 if device_type == "cpu" else torch.finfo(dtype).bits // 8
    keys, kinds = slots + tokens, list(text.layer_types)
    full, linear = full_layer_bytes(text, tokens, keys, size), linear_layer_bytes(text, 1,
                                                                                  tokens, size)
    layers = (full * kinds.count("full_attention") + linear * kinds.count("linear_attention")
              + max(full, linear))
    hidden = (tokens * keys * size
              + len(kinds) * tokens * (4 * text.hidden_size + 3 * text.intermediate_size) * size)
    return layers + hidden + 2 * answer * text.vocab_size * 4


def full_layer_bytes(text_config, queries: int, keys: int, size: int) -> int:
    """A full-attention layer's work for `queries` (folded) queries over `keys` keys: its K/V
    concatenated and repeated to the query heads, float32 scores and weights."""
    text = text_config
    return (2 * (text.num_key_value_heads + text.num_attention_heads) * keys * text.head_dim
            * size + 2 * text.num_attention_heads * queries * keys * 4)


def linear_layer_bytes(text_config, rows: int, tokens: int, size: int) -> int:
    """A linear-attention layer's work for `rows` rows of `tokens`: three float32 recurrent
    states per row, its chunk kernel's float32 work (64-token chunks) and the conv input."""
    text = text_config
    k_dim, v_dim = text.linear_key_head_dim, text.linear_value_head_dim
    conv = 2 * text.linear_num_key_heads * k_dim + text.linear_num_value_heads * v_dim
    chunk = max(64, -(-tokens // 64) * 64)
    return (rows * text.linear_num_value_heads * 4
            * (3 * k_dim * v_dim + chunk * (2 * chunk + 6 * (k_dim + v_dim)))
            + 2 * rows * conv * (text.linear_conv_kernel_dim + tokens) * size)


def evidence_rows(bound: int, text_config, slots: int, tokens: int, answer: int,
                  dtype: torch.dtype, most: int) -> int:
    """How many rows (at most `most`, at least 1) one batched evidence forward takes so that
    `evidence_batch_bytes` stays within `bound`."""
    return max((rows for rows in range(1, most + 1)
                if evidence_batch_bytes(text_config, rows, slots, tokens, answer, dtype)
                <= bound), default=1)
