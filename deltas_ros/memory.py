"""The DeltaS streaming memory: a Qwen3.5 hybrid model's state and KV cache kept within budget.

    memory = StreamingMemory(load_model(path), MemoryConfig(budget_tokens=8192))
    memory.add_chunk([frame0, frame1], [t0, t1])   # one second of RGB frames at 2 fps
    memory.ask("What did the robot see on the table?")

After every chunk (Algorithm 1): snapshot the Gated DeltaNet states, prefill the chunk, score it
by state drift, and when the full-attention KV cache holds more than M tokens keep the sinks, the
recent window and per temporal bucket the best-scored tokens. Kept tokens keep their positions
(keys are cached after rotary embedding); new tokens continue from the running position counter.
On an endless stream that counter nears the model's max_position_embeddings after a few hours:
then the retained slots are compacted to gap-free positions and their keys re-rotated (rope.py).

The stream lives inside one open user turn of the chat template. A question closes that turn,
is answered greedily, and is then rolled back: recurrent and conv states are restored from a
snapshot (fixed size) and the KV cache is truncated to its old length (no copy of the cache).
A chunk that fails (e.g. CUDA out of memory) is rolled back the same way.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NoReturn

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from .chunks import DEFAULT_PIXEL_BUDGET, Chunk, ChunkBuilder
from .drift import state_drift, write_strength
from .model import LoadedModel
from .policy import ChunkSignals, make_policy, select_keep
from .prompt import ChatLayout
from .rope import RotaryShift, compacted_positions

PREFIX_CHUNK = -1  # chunk index of the chat prefix's slots


def _gather_slots(cache: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """cache[..., keep, :] for a (B, kv_heads, T, head_dim) K or V tensor.

    Through a (B * kv_heads, T, head_dim) view: PyTorch's CPU index_select is faster on it than
    on the 4-D tensor at small sizes (part of the eviction speed-up `bench.engine_overhead`
    shows); test_memory checks it against index_select on the 4-D tensor.
    """
    batch, heads, _, dim = cache.shape
    return cache.reshape(batch * heads, -1, dim).index_select(1, keep).view(batch, heads, -1, dim)


def question_problem(question: str, max_chars: int | None = None, wire: bool = False) -> str:
    """Why a question is refused, or "" when it is fine.

    wire: the question came in a ROS message. A string that was not valid UTF-8 on the wire
    reaches Python with U+FFFD in place of the bad bytes (rclpy decodes with "replace");
    answering a mangled question would hide the client's bug, so it is refused. (From Python, a
    U+FFFD is just a character.)
    """
    if not question.strip():
        return "the question is empty"
    if max_chars is not None and len(question) > max_chars:
        return f"the question has {len(question)} characters; the limit is {max_chars}"
    if wire and "\ufffd" in question:
        return ("the question contains U+FFFD: it was not valid UTF-8 when sent (or carried a "
                "replacement character)")
    return ""


class ChunkFailed(RuntimeError):
    """A chunk could not be ingested; the memory was rolled back to its state before it."""


class QuestionFailed(RuntimeError):
    """A question could not be answered; the memory was left as it was before it."""


@dataclass
class MemoryConfig:
    """How much the memory holds and how it chooses (defaults: the paper's).

    compact_margin: positions kept free below max_position_embeddings for questions and their
    answers; positions are compacted when a chunk would reach into them.
    """

    budget_tokens: int = 8192
    sink_tokens: int = 4
    window_tokens: int = 1024
    buckets: int = 4
    policy: str = "deltas"
    seed: int = 0
    pixel_budget: int = DEFAULT_PIXEL_BUDGET
    max_new_tokens: int = 64
    evidence_chunks: int = 3
    compact_margin: int = 4096

    def __post_init__(self) -> None:
        if self.budget_tokens < self.sink_tokens + self.window_tokens:
            raise ValueError(
                f"budget_tokens ({self.budget_tokens}) must be at least sink_tokens + "
                f"window_tokens ({self.sink_tokens} + {self.window_tokens})"
            )
        if self.buckets < 1 or min(self.sink_tokens, self.window_tokens) < 0:
            raise ValueError("buckets must be >= 1, sink_tokens and window_tokens >= 0")
        if self.compact_margin < 0:
            raise ValueError(f"compact_margin must be >= 0, got {self.compact_margin}")
        make_policy(self.policy, self.seed)  # raises for unknown names


@dataclass
class ChunkResult:
    """What one chunk did to the memory, with its cost in milliseconds."""

    index: int
    time: float
    drift: float
    layer_drift: list[float]
    chunk_tokens: int
    kv_tokens: int
    evicted_tokens: int
    forward_ms: float
    signal_ms: float
    evict_ms: float
    stamp: float | None = None
    positions_freed: int = 0  # by a position compaction just before this chunk


@dataclass
class Answer:
    """A question's answer and where in the retained stream it looked."""

    text: str
    evidence_times: list[float]
    evidence_stamps: list[float | None]
    memory_tokens: int
    span_start: float
    span_end: float
    latency_ms: float
    generated_tokens: int


@dataclass
class MemoryStats:
    """Size and contents of the memory right now."""

    chunks: int
    kv_tokens: int
    kv_bytes: int
    state_bytes: int
    next_position: int
    max_positions: int
    span_start: float
    span_end: float
    retained_chunks: list[int] = field(default_factory=list)
    compactions: int = 0


@dataclass
class MemoryState:
    """Everything a stream continues from: what persist.py writes and reads.

    tensors, by name (i: the model's layer index; T: cache slots):
        layers.{i}.recurrent_state  (B, Hv, dk, dv) float32    linear-attention layers
        layers.{i}.conv_state       (B, conv_channels, kernel)  linear-attention layers
        layers.{i}.keys, .values    (B, kv_heads, T, head_dim)  full-attention layers, keys rotated
        slots.time (T,) float64, slots.score (T,) float32, slots.chunk (T,) int64,
        slots.position (3, T) int64
    """

    tensors: dict[str, torch.Tensor]
    next_position: int
    chunks_seen: int
    compactions: int
    chunk_stamps: dict[int, float | None]


@dataclass
class _Snapshot:
    """What a chunk or a question may change; tensors that are only ever replaced, by reference."""

    recurrent: list[torch.Tensor]
    conv: list[torch.Tensor]
    kv_tokens: int
    next_position: int
    chunks_seen: int
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    chunk_stamps: dict[int, float | None]


class StreamingMemory:
    """Bounded video memory over one Qwen3.5 model (batch size 1, not thread-safe)."""

    def __init__(self, loaded: LoadedModel, config: MemoryConfig | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.config = config or MemoryConfig()
        self.policy = make_policy(self.config.policy, self.config.seed)
        self.builder = ChunkBuilder.for_model(self.model, self.tokenizer, self.config.pixel_budget)
        text_config = self.model.config.text_config
        self._linear = [i for i, kind in enumerate(text_config.layer_types)
                        if kind == "linear_attention"]
        self._full = [i for i, kind in enumerate(text_config.layer_types)
                      if kind == "full_attention"]
        self.max_positions = text_config.max_position_embeddings
        self._rotary_shift = RotaryShift(self.model.model.language_model.rotary_emb)
        self._stop_ids = {self.tokenizer.convert_tokens_to_ids(t)
                          for t in ("<|im_end|>", "<|endoftext|>")}
        self.layout = ChatLayout.from_tokenizer(self.tokenizer)
        self.reset()

    # ----------------------------------------------------------------------------- streaming
    def reset(self) -> None:
        """Forget everything and open a new stream with the chat prefix (the attention sinks)."""
        self.cache = DynamicCache(config=self.model.config.text_config)
        self.next_position = 0
        self.chunks_seen = 0
        self.compactions = 0
        self.slot_time = torch.empty(0, dtype=torch.float64)
        self.slot_score = torch.empty(0, dtype=torch.float32)
        self.slot_chunk = torch.empty(0, dtype=torch.long)
        self.slot_position = torch.empty(3, 0, dtype=torch.long)  # T/H/W rows of each slot
        self.chunk_stamps: dict[int, float | None] = {}
        ids, positions = self.builder.text(self.layout.prefix, 0)
        self._prefill(ids, positions)
        self.next_position = positions.max().item() + 1
        # The chat framing is never evicted: +inf score, stream time 0.
        self._append_slots(ids.shape[1], time_s=0.0, chunk=PREFIX_CHUNK,
                           scores=torch.full((ids.shape[1],), math.inf), positions=positions)

    @torch.inference_mode()
    def add_chunk(
        self, frames: Sequence[np.ndarray], times: Sequence[float], stamp: float | None = None
    ) -> ChunkResult:
        """Ingest one chunk: RGB uint8 frames (H x W x 3) and their stream times in seconds.

        stamp: the chunk's last frame's header stamp (seconds), reported back as evidence.
        Bad frames raise ValueError before anything changes. A failure while ingesting (e.g.
        out of memory) rolls the memory back to its state before the chunk and raises ChunkFailed;
        a position compaction the chunk needed first stays (it is complete on its own).
        """
        chunk = self.builder.build(frames, times, self.next_position)
        freed = self._make_room(chunk.next_position - self.next_position,
                                self.config.compact_margin)
        if freed:
            chunk = replace(chunk, position_ids=chunk.position_ids - freed,
                            next_position=chunk.next_position - freed)
        t0 = self._now()
        snapshot = self._snapshot()
        try:
            return self._ingest(chunk, stamp, snapshot, t0, freed)
        except BaseException as error:
            failure = error
            traceback.clear_frames(error.__traceback__)  # drop the failed forward's tensors
        self._restore(snapshot)
        del snapshot
        self._raise_rolled_back(ChunkFailed, f"chunk {self.chunks_seen}", failure)

    def _ingest(
        self, chunk: Chunk, stamp: float | None, snapshot: _Snapshot, t0: float, freed: int
    ) -> ChunkResult:
        """Prefill, score and evict; may leave the memory half-updated if it raises."""
        t1 = self._now()
        strengths: list[torch.Tensor] = []
        with self._recording_write_strength(strengths):
            self._prefill_chunk(chunk)
        t2 = self._now()
        drift, per_layer = state_drift(snapshot.recurrent, self._recurrent_states())
        t3 = self._now()

        index = self.chunks_seen
        signals = ChunkSignals(
            index=index,
            num_tokens=chunk.num_tokens,
            drift=drift,
            keys=[self.cache.layers[i].keys[..., -chunk.num_tokens:, :] for i in self._full],
            values=[self.cache.layers[i].values[..., -chunk.num_tokens:, :] for i in self._full],
            write_strength=(torch.stack([s.mean() for s in strengths]).mean().item()
                            if strengths else None),
        )
        self._append_slots(chunk.num_tokens, chunk.time, index, self.policy.score(signals),
                           chunk.position_ids)
        self.chunks_seen += 1
        self.chunk_stamps[index] = stamp
        self.next_position = chunk.next_position
        t4 = self._now()
        evicted = self._evict_if_over_budget()
        t5 = self._now()
        return ChunkResult(
            index=index,
            time=chunk.time,
            drift=drift,
            layer_drift=per_layer,
            chunk_tokens=chunk.num_tokens,
            kv_tokens=self.kv_tokens,
            evicted_tokens=evicted,
            forward_ms=(t2 - t1) * 1e3,
            signal_ms=((t1 - t0) + (t3 - t2)) * 1e3,
            evict_ms=(t5 - t4) * 1e3 if evicted else 0.0,
            stamp=stamp,
            positions_freed=freed,
        )

    def _prefill_chunk(self, chunk: Chunk) -> None:
        dev = self.device
        self.model.model(
            input_ids=chunk.input_ids.to(dev),
            pixel_values_videos=chunk.pixel_values.to(dev, self.loaded.dtype),
            video_grid_thw=chunk.grid_thw.to(dev),
            mm_token_type_ids=chunk.mm_token_type_ids.to(dev),
            position_ids=chunk.position_ids.to(dev),
            cache=self.cache,
            use_cache=True,
        )

    @torch.inference_mode()
    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Text through the language model; returns the last hidden state (1, L, hidden)."""
        out = self.model.model(
            input_ids=ids.to(self.device), position_ids=positions.to(self.device),
            cache=self.cache, use_cache=True,
        )
        return out.last_hidden_state

    def _evict_if_over_budget(self) -> int:
        """Algorithm 1, lines 6-10. Returns how many slots were evicted.

        Everything is gathered before anything is replaced, so a failure changes nothing (at the
        cost of holding the old and the kept KV of all layers at once).
        """
        total = self.kv_tokens
        cfg = self.config
        if total <= cfg.budget_tokens:
            return 0
        keep = select_keep(
            self.slot_time, self.slot_score, cfg.budget_tokens, cfg.sink_tokens,
            cfg.window_tokens, self.policy.buckets or cfg.buckets,
        )
        keep_dev = keep.to(self.device)
        layers = [self.cache.layers[i] for i in self._full]
        kept = [(_gather_slots(layer.keys, keep_dev), _gather_slots(layer.values, keep_dev))
                for layer in layers]
        slots = (self.slot_time[keep], self.slot_score[keep], self.slot_chunk[keep],
                 self.slot_position[:, keep])
        retained = set(slots[2].unique_consecutive().tolist())  # chunks never decrease
        stamps = {c: s for c, s in self.chunk_stamps.items() if c in retained}
        for layer, (keys, values) in zip(layers, kept):
            layer.keys, layer.values = keys, values
        self.slot_time, self.slot_score, self.slot_chunk, self.slot_position = slots
        self.chunk_stamps = stamps
        return total - keep.numel()

    def _append_slots(
        self, n: int, time_s: float, chunk: int, scores: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """positions: (3, 1, n) the slots' position ids, as fed to the model."""
        self.slot_time = torch.cat([self.slot_time, torch.full((n,), time_s, dtype=torch.float64)])
        self.slot_score = torch.cat([self.slot_score, scores.float().cpu()])
        self.slot_chunk = torch.cat([self.slot_chunk, torch.full((n,), chunk, dtype=torch.long)])
        self.slot_position = torch.cat([self.slot_position, positions[:, 0, :].long().cpu()], 1)

    # ----------------------------------------------------------------------------- positions
    @torch.inference_mode()
    def compact_positions(self) -> int:
        """Give the retained slots gap-free positions; returns how many positions it freed.

        Each slot moves by one shift on all three rows (vision blocks keep their T/H/W layout, see
        `rope.compacted_positions`) and its cached key is re-rotated by that shift. Values and the
        linear-attention states hold no positions and stay. All new keys are computed before any
        is replaced, so a failure leaves the memory as it was.
        """
        positions, end = compacted_positions(self.slot_position)
        shift = positions - self.slot_position
        moved = shift.any(0).nonzero()
        if end == self.next_position and moved.numel() == 0:
            return 0
        if moved.numel():
            first = int(moved[0])  # the slots before it keep their positions
            layers = [self.cache.layers[i] for i in self._full]
            keys = [torch.cat([layer.keys[..., :first, :],
                               self._rotary_shift(layer.keys[..., first:, :], shift[:, first:])],
                              dim=-2)
                    for layer in layers]
            for layer, new_keys in zip(layers, keys):
                layer.keys = new_keys
        freed = self.next_position - end
        self.slot_position, self.next_position = positions, end
        self.compactions += 1
        return freed

    def _make_room(self, span: int, margin: int) -> int:
        """Compact positions if `span` more would pass max_positions - margin; raise if it still
        would not fit under max_positions. Returns the positions freed."""
        freed = 0
        if self.next_position + span > self.max_positions - margin:
            freed = self.compact_positions()
        self._check_positions(self.next_position + span)
        return freed

    # ----------------------------------------------------------------------------- asking
    @torch.inference_mode()
    def ask(self, question: str, max_new_tokens: int | None = None) -> Answer:
        """Answer from what the memory holds; the memory is left bit-identical.

        Only if the question and its answer would pass max_position_embeddings are the positions
        compacted first. A failure while answering (e.g. out of memory) raises QuestionFailed.
        """
        if problem := question_problem(question):
            raise ValueError(problem)
        start = time.perf_counter()
        limit = max_new_tokens or self.config.max_new_tokens
        ids, _ = self._question_ids(question)
        self._make_room(ids.shape[1] + limit, margin=0)
        kv_before = self.kv_tokens
        snapshot = self._snapshot()
        try:
            generated, evidence = self._answer(question, kv_before, limit)
        except BaseException as error:
            failure = error
            traceback.clear_frames(error.__traceback__)
        else:
            failure = None
        self._restore(snapshot)
        del snapshot
        if failure is not None:
            self._raise_rolled_back(QuestionFailed, "the question", failure)
        chunk_slots = self.slot_chunk >= 0
        times = self.slot_time[chunk_slots]
        return Answer(
            text=self.tokenizer.decode(generated, skip_special_tokens=True).strip(),
            evidence_times=[self._chunk_time(c) for c in evidence],
            evidence_stamps=[self.chunk_stamps.get(c) for c in evidence],
            memory_tokens=kv_before,
            span_start=times.min().item() if times.numel() else 0.0,
            span_end=times.max().item() if times.numel() else 0.0,
            latency_ms=(time.perf_counter() - start) * 1e3,
            generated_tokens=len(generated),
        )

    def _answer(self, question: str, kv_before: int, limit: int) -> tuple[list[int], list[int]]:
        """Prefill the question and decode: (generated token ids, evidence chunks)."""
        ids, positions = self._question_ids(question)
        with self._attention_weights() as weights:
            hidden = self._prefill(ids, positions)
        evidence = self._evidence(weights, kv_before)
        return self._greedy(hidden, positions.max().item() + 1, limit), evidence

    def _question_ids(self, question: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens closing the user turn with the question, at the running position."""
        ids = self.layout.question_ids(self.tokenizer, question)
        start = self.next_position
        return torch.tensor([ids]), torch.arange(start, start + len(ids)).expand(3, 1, -1)

    def _greedy(self, hidden: torch.Tensor, position: int, limit: int) -> list[int]:
        """Greedy decoding until end of turn or `limit` tokens."""
        generated: list[int] = []
        for _ in range(limit):
            token = self.model.lm_head(hidden[:, -1]).argmax(-1).item()
            if token in self._stop_ids:
                break
            generated.append(token)
            ids = torch.tensor([[token]])
            hidden = self._prefill(ids, torch.full((3, 1, 1), position))
            position += 1
        return generated

    def _evidence(self, weights: list[torch.Tensor], kv_before: int) -> list[int]:
        """Chunks the question's attention falls on most: mass over layers, heads and tokens."""
        if not weights:
            return []
        mass = torch.stack([w[0, :, :, :kv_before].float().sum((0, 1)).cpu() for w in weights])
        per_chunk = torch.zeros(self.chunks_seen)
        chunk_slots = self.slot_chunk >= 0
        per_chunk.index_add_(0, self.slot_chunk[chunk_slots], mass.sum(0)[chunk_slots])
        retained = torch.unique(self.slot_chunk[chunk_slots])
        k = min(self.config.evidence_chunks, retained.numel())
        best = retained[per_chunk[retained].topk(k).indices] if k else retained
        return best.tolist()

    @contextmanager
    def _attention_weights(self) -> Iterator[list[torch.Tensor]]:
        """Eager attention for one forward, collecting each full-attention layer's weights."""
        text_config = self.model.config.text_config
        implementation = text_config._attn_implementation
        weights: list[torch.Tensor] = []
        hooks = [
            module.register_forward_hook(lambda _m, _i, out: weights.append(out[1]))
            for module in self.model.modules()
            if isinstance(module, modeling_qwen3_5.Qwen3_5Attention)
        ]
        text_config._attn_implementation = "eager"
        try:
            yield weights
        finally:
            text_config._attn_implementation = implementation
            for hook in hooks:
                hook.remove()

    def _snapshot(self) -> _Snapshot:
        """Everything a chunk or a question may change, at fixed size (the KV cache only by its
        length: it only grows at the end until an eviction, which replaces all layers at once)."""
        layers = [self.cache.layers[i] for i in self._linear]
        return _Snapshot(
            recurrent=[layer.recurrent_states[0].clone() for layer in layers],
            conv=[layer.conv_states[0].clone() for layer in layers],
            kv_tokens=self.kv_tokens,
            next_position=self.next_position,
            chunks_seen=self.chunks_seen,
            slots=(self.slot_time, self.slot_score, self.slot_chunk, self.slot_position),
            chunk_stamps=dict(self.chunk_stamps),
        )

    def _restore(self, snap: _Snapshot) -> None:
        for i, recurrent, conv in zip(self._linear, snap.recurrent, snap.conv):
            self.cache.layers[i].recurrent_states[0].copy_(recurrent)
            self.cache.layers[i].conv_states[0].copy_(conv)
        for i in self._full:
            layer = self.cache.layers[i]
            layer.keys = layer.keys[..., :snap.kv_tokens, :]
            layer.values = layer.values[..., :snap.kv_tokens, :]
        self.next_position = snap.next_position
        self.chunks_seen = snap.chunks_seen
        self.slot_time, self.slot_score, self.slot_chunk, self.slot_position = snap.slots
        self.chunk_stamps = snap.chunk_stamps

    def _raise_rolled_back(
        self, kind: type[RuntimeError], what: str, failure: BaseException
    ) -> NoReturn:
        """Raise after a rollback, outside the except block so the failed tensors are gone."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not isinstance(failure, Exception):  # KeyboardInterrupt, SystemExit: not ours to wrap
            raise failure
        raise kind(f"{what} failed and was rolled back: {type(failure).__name__}: {failure}"
                   ) from failure

    # ----------------------------------------------------------------------------- persistence
    def export_state(self) -> MemoryState:
        """The stream's whole state, by reference (no copies); see persist.save_memory."""
        tensors: dict[str, torch.Tensor] = {}
        for i in self._linear:
            layer = self.cache.layers[i]
            tensors[f"layers.{i}.recurrent_state"] = layer.recurrent_states[0]
            tensors[f"layers.{i}.conv_state"] = layer.conv_states[0]
        for i in self._full:
            tensors[f"layers.{i}.keys"] = self.cache.layers[i].keys
            tensors[f"layers.{i}.values"] = self.cache.layers[i].values
        tensors |= {"slots.time": self.slot_time, "slots.score": self.slot_score,
                    "slots.chunk": self.slot_chunk, "slots.position": self.slot_position}
        return MemoryState(tensors, self.next_position, self.chunks_seen, self.compactions,
                           dict(self.chunk_stamps))

    @torch.inference_mode()
    def import_state(self, state: MemoryState) -> None:
        """Continue the stream `state` describes; see persist.load_memory.

        Raises ValueError, changing nothing, unless the state fits this model and is consistent.
        """
        self._check_state(state)
        moved = {name: t.to(self.device) if name.startswith("layers.") else t.clone()
                 for name, t in state.tensors.items()}
        for i in self._linear:
            layer = self.cache.layers[i]
            layer.recurrent_states[0].copy_(moved[f"layers.{i}.recurrent_state"])
            layer.conv_states[0].copy_(moved[f"layers.{i}.conv_state"])
        for i in self._full:
            layer = self.cache.layers[i]
            layer.keys, layer.values = moved[f"layers.{i}.keys"], moved[f"layers.{i}.values"]
        self.slot_time, self.slot_score = moved["slots.time"], moved["slots.score"]
        self.slot_chunk, self.slot_position = moved["slots.chunk"], moved["slots.position"]
        self.next_position = state.next_position
        self.chunks_seen = state.chunks_seen
        self.compactions = state.compactions
        self.chunk_stamps = dict(state.chunk_stamps)

    def _check_state(self, state: MemoryState) -> None:
        """Names, dtypes and shapes as this memory's own (T slots), and counters that agree."""
        ours = self.export_state().tensors
        if state.tensors.keys() != ours.keys():
            missing, extra = ours.keys() - state.tensors.keys(), state.tensors.keys() - ours.keys()
            raise ValueError(f"the state's tensors do not fit this model: missing "
                             f"{sorted(missing) or 'none'}, unexpected {sorted(extra) or 'none'}")
        slots = state.tensors["slots.time"].shape[-1]
        for name, tensor in state.tensors.items():
            shape = list(ours[name].shape)
            if name.startswith("slots."):
                shape[-1] = slots
            elif name.endswith((".keys", ".values")):
                shape[-2] = slots
            if tensor.dtype != ours[name].dtype or list(tensor.shape) != shape:
                raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, this memory "
                                 f"needs {ours[name].dtype} {tuple(shape)}")
        positions, chunks = state.tensors["slots.position"], state.tensors["slots.chunk"]
        if not slots:
            raise ValueError("the state holds no slots, not even the chat prefix")
        if not 0 < state.next_position <= self.max_positions:
            raise ValueError(f"next_position {state.next_position} is outside this model's "
                             f"max_position_embeddings ({self.max_positions})")
        if positions.min() < 0 or positions.max() >= state.next_position:
            raise ValueError(f"slot positions outside [0, next_position {state.next_position})")
        if chunks.max() >= state.chunks_seen or any(
                not 0 <= c < state.chunks_seen for c in state.chunk_stamps):
            raise ValueError(f"chunk indices beyond the {state.chunks_seen} chunks seen")

    # ----------------------------------------------------------------------------- accounting
    @property
    def kv_tokens(self) -> int:
        return self.cache.layers[self._full[0]].get_seq_length()

    def stats(self) -> MemoryStats:
        """Current size (tokens and bytes) and which chunks are still held."""
        kv_bytes = sum(self.cache.layers[i].keys.nbytes + self.cache.layers[i].values.nbytes
                       for i in self._full)
        state_bytes = sum(self.cache.layers[i].recurrent_states[0].nbytes
                          + self.cache.layers[i].conv_states[0].nbytes for i in self._linear)
        chunk_slots = self.slot_chunk >= 0
        times = self.slot_time[chunk_slots]
        return MemoryStats(
            chunks=self.chunks_seen,
            kv_tokens=self.kv_tokens,
            kv_bytes=kv_bytes,
            state_bytes=state_bytes,
            next_position=self.next_position,
            max_positions=self.max_positions,
            span_start=times.min().item() if times.numel() else 0.0,
            span_end=times.max().item() if times.numel() else 0.0,
            retained_chunks=torch.unique(self.slot_chunk[chunk_slots]).tolist(),
            compactions=self.compactions,
        )

    # ----------------------------------------------------------------------------- helpers
    def _recurrent_states(self) -> list[torch.Tensor]:
        return [self.cache.layers[i].recurrent_states[0] for i in self._linear]

    def _chunk_time(self, chunk: int) -> float:
        return self.slot_time[self.slot_chunk == chunk][0].item()

    def _check_positions(self, needed: int) -> None:
        if needed > self.max_positions:
            raise RuntimeError(
                f"position {needed} would exceed the model's max_position_embeddings "
                f"({self.max_positions}) even with compacted positions; reset the memory"
            )

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def _recording_write_strength(self, sink: list[torch.Tensor]) -> Iterator[None]:
        """While active, each Gated DeltaNet prefill also appends beta*||e|| per token to sink.

        Only for policies that score by it: it replays the recurrence token by token.
        """
        if not self.policy.needs_write_strength:
            yield
            return
        bound = modeling_qwen3_5.torch_chunk_gated_delta_rule

        def recording(query, key, value, g, beta, initial_state=None, **kwargs):
            sink.append(write_strength(key, value, g, beta, initial_state,
                                       kwargs.get("use_qk_l2norm_in_kernel", False)))
            return bound(query, key, value, g=g, beta=beta, initial_state=initial_state,
                         **kwargs)

        modeling_qwen3_5.torch_chunk_gated_delta_rule = recording
        try:
            yield
        finally:
            modeling_qwen3_5.torch_chunk_gated_delta_rule = bound
