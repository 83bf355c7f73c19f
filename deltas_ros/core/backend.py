"""The door to transformers' Qwen3.5 internals: the model's cache and every call into it.

Everything the memory does to the model goes through `Backend` (batch size 1): prefill a chunk or
text, one decoding step, snapshot/restore of the linear-attention states (and forwards undone on
the spot), the KV length, moving and truncating KV slots, re-rotating cached keys, the attention
mass of a question on each slot, the folded forward the evidence search batches its rows in, and
the recording of a per-token signal of the gated delta rule. Only this module and `kernels`
(which kernel each Gated DeltaNet module runs) import `transformers.models.qwen3_5`;
`evidence_forward` and training's `cache` subclass or fill transformers' public cache class, the
loader and the model maker use its public classes only.

Private transformers names the door relies on (test_backend pins each of them, so an upgrade
that moves one fails naming it):

    modeling_qwen3_5.Qwen3_5GatedDeltaNet          .forward, whose body calls the module globals
                                                    torch_chunk_gated_delta_rule and
                                                    torch_recurrent_gated_delta_rule (kernels)
    modeling_qwen3_5.torch_chunk_gated_delta_rule   functools.wraps wrappers (fla's kernel when
    modeling_qwen3_5.torch_recurrent_gated_delta_rule  fla imports); __wrapped__ is pure torch
    modeling_qwen3_5.Qwen3_5Attention               .q_proj .q_norm .head_dim .scaling
                                                    .num_key_value_groups .layer_idx, called with
                                                    hidden_states= and position_embeddings=
                                                    (forward and pre-forward hooks)
    modeling_qwen3_5.apply_rotary_pos_emb           (q, k, cos, sin) -> rotated (q, k)
    modeling_qwen3_5.rotate_half                    the pairing rope.rotate_half reproduces
    Qwen3_5TextRotaryEmbedding.recomposition_frequencies, .inv_freq
    model.model.language_model.rotary_emb, model.model(..., cache=, position_ids=,
        mm_token_type_ids=, attention_mask={layer type: mask}), model.lm_head
    cache_utils.DynamicCache(config=) .layers[i] .keys .values .get_seq_length()
        .recurrent_states[0] .conv_states[0]
    for training (training/cache.py): the linear-attention layer's .conv_kernel_size .dtype
        .device .is_conv_states_initialized .is_recurrent_states_initialized
        .has_previous_state .record_past .update_recurrent_state(recurrent_states, state_idx),
        and the attention layer's .lazy_initialization(keys, values)

No process-wide patching: the gated delta kernels are chosen per model instance (`kernels`),
and the write strength is recorded per call (a context variable the instance's kernel reads).
Evidence attention is computed from the question's own queries and the cached keys in bounded
slices (`kv_ops.attention_mass_of`), so the model keeps its fast attention and no config
switch is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from .chunks import Chunk
from .drift import drift_of_views, drift_views
from .kernels import recording_write_strength, select_gated_delta_kernels
from .kv_ops import attention_mass_of, gather_slots, move_slots
from .rope import RotaryShift
from .signals import state_surprise, write_strength


@dataclass
class StateSnapshot:
    """The linear-attention states and the KV length at one moment: all a rollback needs.

    The states themselves sit in the backend's buffers (`_StateBuffers`, one snapshot row
    reused from snapshot to snapshot): a snapshot is valid until the next `Backend.snapshot`
    (`generation` says which one; restore and drift refuse a stale one).
    """

    kv_tokens: int
    generation: int


class Backend:
    """One Qwen3.5 model with one stream's cache (batch 1, not thread-safe)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        text = model.config.text_config
        self.linear = [i for i, k in enumerate(text.layer_types) if k == "linear_attention"]
        self.full = [i for i, k in enumerate(text.layer_types) if k == "full_attention"]
        self.max_positions: int = text.max_position_embeddings
        self.rotary_shift = RotaryShift.of(model)
        self.cache = DynamicCache(config=text)
        self.fla_kernels = select_gated_delta_kernels(model, device)  # per instance; idempotent
        self.strength_fn: Callable = write_strength  # a benchmark may wrap them to time them
        self.surprise_fn: Callable = state_surprise
        self.buffers: _StateBuffers | None = None
        self._generation = 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config.text_config)

    def now(self) -> float:
        """perf_counter after the device's queued work: what the timings of a chunk read."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ----------------------------------------------------------------------------- forward
    def prefill_text(self, ids: torch.Tensor, positions: torch.Tensor,
                     masks: dict[str, torch.Tensor | None] | None = None) -> torch.Tensor:
        """ids (1, L), positions (3, 1, L) through the language model; returns (1, L, hidden).
        masks: {layer type: mask} given to the layers instead of the ones transformers makes."""
        out = self.model.model(input_ids=ids.to(self.device),
                               position_ids=positions.to(self.device),
                               attention_mask=masks, cache=self.cache, use_cache=True)
        return out.last_hidden_state

    def prefill_chunk(self, chunk: Chunk) -> None:
        dev = self.device
        self.model.model(
            input_ids=chunk.input_ids.to(dev),
            pixel_values_videos=chunk.pixel_values.to(dev, self.dtype),
            video_grid_thw=chunk.grid_thw.to(dev),
            mm_token_type_ids=chunk.mm_token_type_ids.to(dev),
            position_ids=chunk.position_ids.to(dev),
            cache=self.cache,
            use_cache=True,
        )

    def next_token(self, hidden: torch.Tensor) -> int:
        """Greedy choice after the last of hidden (1, L, hidden)."""
        return int(self.model.lm_head(hidden[:, -1]).argmax(-1).item())

    def log_prob(self, hidden: torch.Tensor, targets: list[int]) -> float:
        """log p of `targets` (L,), each predicted from the hidden state (1, L, hidden) before it:
        the sum of their log-softmax scores."""
        return float(self.log_prob_tensor(hidden, targets))

    def log_prob_tensor(self, hidden: torch.Tensor, targets: list[int]) -> torch.Tensor:
        """`log_prob` as a 0-d float32 tensor, differentiable where `hidden` is."""
        scores = self.model.lm_head(hidden[0]).float().log_softmax(-1)
        picked = scores.gather(1, torch.tensor(targets, device=self.device)[:, None])
        return picked.sum()

    def prefill_rows(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                     cache: DynamicCache) -> torch.Tensor:
        """tokens (B, L) at positions (3, B, L) through the language model over `cache` (a
        `evidence_forward.BranchCache`), the full-attention layers under the additive `mask` and
        with the rows folded into one (`folded_attention`); returns (B, L, hidden)."""
        with self.folded_attention():
            out = self.model.model.language_model(
                input_ids=tokens, position_ids=positions,
                attention_mask={"full_attention": mask, "linear_attention": None},
                cache=cache, use_cache=True)
        return out.last_hidden_state

    @contextmanager
    def folded_attention(self) -> Iterator[None]:
        """While active, each full-attention layer takes its (B, L, hidden) input as one row
        (1, B*L, hidden), with its rotary embeddings folded alike, and gives its output back as
        (B, L, hidden): the projections work per token, so only the attention itself changes,
        to one batch-1 attention of B*L queries (its mask must be laid out so, `branch_mask`).
        """
        shapes: list[torch.Size] = []

        def fold(_module, args, kwargs):
            hidden = kwargs["hidden_states"]
            shapes.append(hidden.shape)
            cos, sin = kwargs["position_embeddings"]
            return args, kwargs | {
                "hidden_states": hidden.reshape(1, -1, hidden.shape[-1]),
                "position_embeddings": (cos.reshape(1, -1, cos.shape[-1]),
                                        sin.reshape(1, -1, sin.shape[-1]))}

        def unfold(_module, _args, _kwargs, output):
            out, weights = output
            return out.view(shapes.pop()), weights

        modules = [m for m in self.model.modules()
                   if isinstance(m, modeling_qwen3_5.Qwen3_5Attention)]
        hooks = [h for m in modules for h in (
            m.register_forward_pre_hook(fold, with_kwargs=True),
            m.register_forward_hook(unfold, with_kwargs=True))]
        try:
            yield
        finally:
            for handle in hooks:
                handle.remove()

    def step(self, token: int, position: int) -> torch.Tensor:
        """One decoding step of `token` at `position` (all three rows); returns (1, 1, hidden).

        On the CPU the full-attention layers get an explicit all-visible mask: without one,
        transformers hands SDPA its grouped-query mode, which there reads a single query
        against every cached slot about five times slower than the query packed onto its key
        heads, what transformers does under a mask (at M = 8192 in the 0.8B dimensions, ~16
        against ~3 ms a layer a token; bench.real_size)."""
        masks = None if self.device.type != "cpu" else {
            "full_attention": torch.ones(1, 1, 1, self.kv_tokens + 1, dtype=torch.bool),
            "linear_attention": None}
        return self.prefill_text(torch.tensor([[token]]), torch.full((3, 1, 1), position), masks)

    # ----------------------------------------------------------------------------- states
    def recurrent_states(self) -> list[torch.Tensor]:
        return [self.cache.layers[i].recurrent_states[0] for i in self.linear]

    def conv_states(self) -> list[torch.Tensor]:
        return [self.cache.layers[i].conv_states[0] for i in self.linear]

    def snapshot(self) -> StateSnapshot:
        """Copy the states into the snapshot rows of their stacked buffers (`_StateBuffers`):
        one copy when the conv states are float32 like the recurrent ones, else two.
        Invalidates the previous snapshot."""
        for snapshot, live in self._state_buffers().copies:
            snapshot.copy_(live)
        self._generation += 1
        return StateSnapshot(self.kv_tokens, self._generation)

    def drift(self, snap: StateSnapshot) -> tuple[float, list[float]]:
        """State drift (Eq. 3) from `snap` to now: drift.drift_of_views on the stacked states
        (three ops on views made once, one host sync; nothing is copied first)."""
        self._check_current(snap)
        return drift_of_views(*self._state_buffers(adopt=False).drift_views)

    def restore(self, snap: StateSnapshot) -> None:
        """Copy the states back (one or two copies) and cut the KV cache to its length at the
        snapshot."""
        self._check_current(snap)
        for snapshot, live in self._state_buffers(adopt=False).copies:
            live.copy_(snapshot)
        self.truncate(snap.kv_tokens)

    @contextmanager
    def undone(self) -> Iterator[None]:
        """While active, forwards may change the states and grow the KV; on exit both are as
        before: the states are saved into the buffers' scratch row (not the snapshot's, so a
        snapshot taken before stays valid) and copied back, the KV cut to its old length."""
        saves, length = self._state_buffers().saves, self.kv_tokens
        for save, live in saves:
            save.copy_(live)
        try:
            yield
        finally:
            for save, live in saves:
                live.copy_(save)
            self.truncate(length)

    def _state_buffers(self, adopt: bool = True) -> _StateBuffers:
        """The stacked buffers the cache's states live in; a new cache (after reset) has its
        states moved in first (adopt), else RuntimeError."""
        buffers = self.buffers
        if buffers is None or not buffers.holds(self.cache, self.linear):
            if not adopt:
                raise RuntimeError("the linear-attention states were replaced since the "
                                   "snapshot")
            buffers = self.buffers = _StateBuffers(self.cache, self.linear)
        return buffers

    def _check_current(self, snap: StateSnapshot) -> None:
        if snap.generation != self._generation:
            raise RuntimeError(f"stale state snapshot {snap.generation} (the buffers now hold "
                               f"snapshot {self._generation})")

    # ----------------------------------------------------------------------------- KV slots
    @property
    def kv_tokens(self) -> int:
        return self.cache.layers[self.full[0]].get_seq_length()

    def truncate(self, length: int) -> None:
        for i in self.full:
            layer = self.cache.layers[i]
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    def newest(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of the last n slots, one (1, kv_heads, n, head_dim) per layer."""
        layers = [self.cache.layers[i] for i in self.full]
        return ([layer.keys[..., -n:, :] for layer in layers],
                [layer.values[..., -n:, :] for layer in layers])

    def move(self, moves: Sequence[tuple[int, int, int]], size: int) -> None:
        """The eviction's one K/V path: every full-attention layer cut to `size` slots with the
        moves (to, source, count) of slot ranges (SlotTable.keep_slots) applied, through
        `move_slots`: one copy per K/V tensor, from a slice when the movers are one range. The
        movers of every layer are read before anything is written, so a failure changes
        nothing."""
        self.replace_kv(move_slots(self.kv_tensors(), moves, size, self.device_index))

    def kv_tensors(self) -> list[torch.Tensor]:
        """Keys and values of every full-attention layer: [keys 0, values 0, keys 1, ...]."""
        return [t for i in self.full for t in (self.cache.layers[i].keys,
                                               self.cache.layers[i].values)]

    def replace_kv(self, tensors: list[torch.Tensor]) -> None:
        """Make `tensors` (laid out as `kv_tensors` gives them) the full-attention layers' K/V."""
        for i, keys, values in zip(self.full, tensors[0::2], tensors[1::2]):
            self.cache.layers[i].keys, self.cache.layers[i].values = keys, values

    def device_index(self, host: torch.Tensor) -> torch.Tensor:
        """A host index tensor on the model's device without waiting for the device: a
        blocking `.to(device)` waits for all queued work, a non-blocking copy from pinned
        memory only queues the copy (the caching host allocator keeps the block until it is
        done). Untested here: CI has no GPU."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def shift_keys(self, first: int, shift: torch.Tensor) -> None:
        """Re-rotate the keys of slots first.. by shift (3, T) (slots before `first` stay);
        all new keys are computed before any is replaced."""
        layers = [self.cache.layers[i] for i in self.full]
        keys = [torch.cat([layer.keys[..., :first, :],
                           self.rotary_shift(layer.keys[..., first:, :], shift[:, first:])],
                          dim=-2)
                for layer in layers]
        for layer, new_keys in zip(layers, keys):
            layer.keys = new_keys

    @contextmanager
    def visible_slots(self, visible: torch.Tensor | None) -> Iterator[None]:
        """While active, the full-attention layers see only slots `visible` (sorted indices):
        each layer's keys and values are swapped for gathered copies, which a question's tokens
        then extend, and the untouched originals are put back on exit. Since cached keys carry
        their rotary positions, attending to the gathered slots is attending with the others
        masked (test_memory compares them). None: no change."""
        if visible is None:
            yield
            return
        layers = [self.cache.layers[i] for i in self.full]
        originals = [(layer.keys, layer.values) for layer in layers]
        visible = visible.to(self.device)
        gathered = [(gather_slots(k, visible), gather_slots(v, visible)) for k, v in originals]
        try:
            for layer, (keys, values) in zip(layers, gathered):
                layer.keys, layer.values = keys, values
            del gathered
            yield
        finally:
            for layer, (keys, values) in zip(layers, originals):
                layer.keys, layer.values = keys, values

    def gather_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cache slots `slots` (n,) at every full-attention layer, as
        cached, on the host: (L, kv_heads, n, head_dim) each (what the second tier keeps)."""
        index = self.device_index(slots)
        layers = [self.cache.layers[i] for i in self.full]
        return (torch.stack([layer.keys[0].index_select(1, index) for layer in layers]).cpu(),
                torch.stack([layer.values[0].index_select(1, index) for layer in layers]).cpu())

    @contextmanager
    def appended_slots(self, keys: torch.Tensor | None, values: torch.Tensor | None
                       ) -> Iterator[None]:
        """While active, the full-attention layers hold recalled slots (L, kv_heads, n,
        head_dim) after the cached ones: keys carry their rotary positions, so they are read
        where they were cached. The untouched originals are put back on exit. None: no
        change."""
        if keys is None:
            yield
            return
        layers = [self.cache.layers[i] for i in self.full]
        originals = [(layer.keys, layer.values) for layer in layers]
        keys, values = (t.to(self.device, self.dtype) for t in (keys, values))
        try:
            for layer, (k, v), new_k, new_v in zip(layers, originals, keys, values):
                layer.keys = torch.cat([k, new_k.unsqueeze(0)], 2)
                layer.values = torch.cat([v, new_v.unsqueeze(0)], 2)
            yield
        finally:
            for layer, (k, v) in zip(layers, originals):
                layer.keys, layer.values = k, v

    # ----------------------------------------------------------------------------- export
    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The cache's tensors by name, by reference (see memory.MemoryState)."""
        tensors: dict[str, torch.Tensor] = {}
        for i in self.linear:
            tensors[f"layers.{i}.recurrent_state"] = self.cache.layers[i].recurrent_states[0]
            tensors[f"layers.{i}.conv_state"] = self.cache.layers[i].conv_states[0]
        for i in self.full:
            tensors[f"layers.{i}.keys"] = self.cache.layers[i].keys
            tensors[f"layers.{i}.values"] = self.cache.layers[i].values
        return tensors

    def import_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the cache's tensors by checked ones of `export_tensors`' names and shapes."""
        # Copies: the fill eviction writes into the cache in place, so it must own its tensors.
        moved = {name: t.to(self.device, copy=True) for name, t in tensors.items()
                 if name.startswith("layers.")}
        for i in self.linear:
            self.cache.layers[i].recurrent_states[0].copy_(moved[f"layers.{i}.recurrent_state"])
            self.cache.layers[i].conv_states[0].copy_(moved[f"layers.{i}.conv_state"])
        for i in self.full:
            layer = self.cache.layers[i]
            layer.keys, layer.values = moved[f"layers.{i}.keys"], moved[f"layers.{i}.values"]

    def nbytes(self) -> tuple[int, int]:
        """(KV bytes, linear-attention state bytes)."""
        kv = sum(self.cache.layers[i].keys.nbytes + self.cache.layers[i].values.nbytes
                 for i in self.full)
        states = sum(self.cache.layers[i].recurrent_states[0].nbytes
                     + self.cache.layers[i].conv_states[0].nbytes for i in self.linear)
        return kv, states

    # ----------------------------------------------------------------------------- signals
    def recording_write_strength(self, enabled: bool = True, signal: str | None = None
                                 ) -> Iterator[list[torch.Tensor]]:
        """While active, each chunked gated delta prefill in this thread appends a per-token
        signal (B, n) to the yielded list (`kernels.recording_write_strength`): beta*||e||
        (replays the recurrence token by token) or, for signal "surprise", state_surprise."""
        fn = self.surprise_fn if signal == "surprise" else self.strength_fn
        return recording_write_strength(fn, enabled)

    @contextmanager
    def attention_mass(self, slots: int) -> Iterator[torch.Tensor]:
        """While active, each full-attention layer's forward adds to the yielded (slots,)
        float32 tensor the attention mass its queries put on cache slots 0..slots-1 (summed
        over heads and query tokens), computed in bounded slices (`attention_mass_of`)."""
        mass = torch.zeros(slots)

        def add(module: torch.nn.Module, queries: torch.Tensor) -> None:
            keys = self.cache.layers[module.layer_idx].keys
            mass.add_(attention_mass_of(queries, keys, module.scaling,
                                        module.num_key_value_groups, slots).cpu())

        with self._on_queries(add):
            yield mass

    @contextmanager
    def question_queries(self) -> Iterator[list[torch.Tensor]]:
        """While active, each full-attention layer's forward appends its rotated queries
        (heads, L, head_dim) to the yielded list, in layer order (what recall scores by)."""
        queries: list[torch.Tensor] = []
        with self._on_queries(lambda _module, q: queries.append(q[0].float().cpu())):
            yield queries

    def first_queries(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(heads, L, head_dim) float32: the rotated queries of text ids (1, L) at positions
        (3, 1, L) at the first full-attention layer. The layers below it are linear attention,
        so these queries depend on the text and the linear-attention states alone, never on
        the KV slots: the forward stops at that layer, and what it did is undone."""
        first = next(module for module in self.model.modules()
                     if isinstance(module, modeling_qwen3_5.Qwen3_5Attention)
                     and module.layer_idx == self.full[0])
        taken: list[torch.Tensor] = []

        def take(module, args, kwargs) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            taken.append(_rotated_queries(module, hidden, kwargs["position_embeddings"])[0]
                         .float().cpu())
            raise _QueriesTaken

        handle = first.register_forward_pre_hook(take, with_kwargs=True)
        try:
            with self.undone():
                self.prefill_text(ids, positions)
        except _QueriesTaken:
            pass
        finally:
            handle.remove()
        return taken[0]

    @contextmanager
    def _on_queries(self, use: Callable[[torch.nn.Module, torch.Tensor], None]
                    ) -> Iterator[None]:
        """Call use(module, queries (1, heads, L, head_dim)) after each full-attention forward."""
        def hook(module, args, kwargs, _output) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            use(module, _rotated_queries(module, hidden, kwargs["position_embeddings"]))

        hooks = [module.register_forward_hook(hook, with_kwargs=True)
                 for module in self.model.modules()
                 if isinstance(module, modeling_qwen3_5.Qwen3_5Attention)]
        try:
            yield
        finally:
            for handle in hooks:
                handle.remove()


class _QueriesTaken(Exception):
    """Stops a forward once `Backend.first_queries` has what it needs."""


def _rotated_queries(module: torch.nn.Module, hidden: torch.Tensor, embeddings) -> torch.Tensor:
    """The attention layer's queries (1, heads, L, head_dim) after rotary, as its forward makes
    them."""
    shape = (*hidden.shape[:-1], -1, module.head_dim)
    query, _gate = torch.chunk(
        module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim * 2), 2, dim=-1)
    query = module.q_norm(query.view(shape)).transpose(1, 2)
    cos, sin = embeddings
    return modeling_qwen3_5.apply_rotary_pos_emb(query, query, cos, sin)[0]


class _StateBuffers:
    """Where the cache's linear-attention states live, stacked so that the snapshot, the drift
    and the rollback of all layers are one to three whole-buffer ops (per-layer work would cost
    more than the data at tiny sizes).

    recurrent (3, L, n) float32, rows zero-padded to the largest state (padding is never
    written, so it adds nothing to a norm): [0] the live states (the cache's state tensors are
    views of its rows, which the model updates in place), [1] scratch for the drift's
    difference (and for `Backend.undone`, whose save never meets a drift), [2] the snapshot.
    The kernels keep their recurrent states in float32 too. conv (3, L, m) of the conv states'
    dtype, rows [0] live, [1] the save of `Backend.undone` and [2] snapshot. When that dtype is
    float32 (a float32 model) both are column ranges of one (3, L, n + m) buffer, so a snapshot
    or a rollback is a single copy; `buffers` lists the one or two buffers to copy.
    """

    def __init__(self, cache: DynamicCache, linear: list[int]) -> None:
        recurrent = [cache.layers[i].recurrent_states[0] for i in linear]
        conv = [cache.layers[i].conv_states[0] for i in linear]
        if any(state is None for state in recurrent + conv):
            raise RuntimeError("the linear-attention states are not initialised yet")
        device, n, m = recurrent[0].device, _widest(recurrent), _widest(conv)
        if conv[0].dtype == torch.float32:
            self.buffers = [torch.zeros(3, len(linear), n + m, device=device)]
            self.recurrent, self.conv = self.buffers[0][..., :n], self.buffers[0][..., n:]
        else:
            self.buffers = [torch.zeros(3, len(linear), n, device=device),
                            torch.zeros(3, len(linear), m, dtype=conv[0].dtype, device=device)]
            self.recurrent, self.conv = self.buffers
        # Views made once, used by every chunk (at tiny sizes making them is much of the cost).
        self.copies = [(buffer[2], buffer[0]) for buffer in self.buffers]  # (snapshot, live)
        self.saves = [(buffer[1], buffer[0]) for buffer in self.buffers]  # (save, live)
        self.drift_views = drift_views(self.recurrent)
        self.live = _rows(self.recurrent[0], recurrent) + _rows(self.conv[0], conv)
        torch._foreach_copy_(self.live, recurrent + conv)
        for i, recurrent_view, conv_view in zip(linear, self.live, self.live[len(linear):]):
            cache.layers[i].recurrent_states[0] = recurrent_view
            cache.layers[i].conv_states[0] = conv_view
        self.cache = cache

    def holds(self, cache: DynamicCache, linear: list[int]) -> bool:
        """Whether `cache`'s states are still the views of these buffers (checked on the first
        layer: the model updates every layer's states the same way, in place; test_backend
        checks all of them after a stream)."""
        return cache is self.cache and cache.layers[linear[0]].recurrent_states[0] is self.live[0]


def _widest(states: list[torch.Tensor]) -> int:
    return max(state.numel() for state in states)


def _rows(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Row i of a (L, n) buffer, cut and viewed to the shape of like[i]."""
    return [row[:t.numel()].view(t.shape) for row, t in zip(buffer.unbind(0), like)]

