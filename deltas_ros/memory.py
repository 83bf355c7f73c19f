"""The DeltaS streaming memory: a Qwen3.5 hybrid model's state and KV cache kept within budget.

    memory = StreamingMemory(load_model(path), MemoryConfig(budget_tokens=8192))
    memory.add_chunk([frame0, frame1], [t0, t1])   # one second of RGB frames at 2 fps
    memory.ask("What did the robot see on the table?")

After every chunk (Algorithm 1): snapshot the Gated DeltaNet states, prefill the chunk, score it
by state drift, and when the full-attention KV cache holds more than M tokens keep the sinks, the
recent window and per temporal bucket the best-scored tokens. Kept tokens keep their positions
(keys are cached after rotary embedding); new tokens continue from the running position counter.

The stream lives inside one open user turn of the chat template. A question closes that turn,
is answered greedily, and is then rolled back: recurrent and conv states are restored from a
snapshot (fixed size) and the KV cache is truncated to its old length (no copy of the cache).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5

from .chunks import DEFAULT_PIXEL_BUDGET, Chunk, ChunkBuilder
from .drift import state_drift, write_strength
from .model import LoadedModel
from .policy import ChunkSignals, make_policy, select_keep

VIDEO_MARKER = "<|vision_start|><|video_pad|><|vision_end|>"
PREFIX_CHUNK = -1  # chunk index of the chat prefix's slots


@dataclass
class MemoryConfig:
    """How much the memory holds and how it chooses (defaults: the paper's)."""

    budget_tokens: int = 8192
    sink_tokens: int = 4
    window_tokens: int = 1024
    buckets: int = 4
    policy: str = "deltas"
    seed: int = 0
    pixel_budget: int = DEFAULT_PIXEL_BUDGET
    max_new_tokens: int = 64
    evidence_chunks: int = 3

    def __post_init__(self) -> None:
        if self.budget_tokens < self.sink_tokens + self.window_tokens:
            raise ValueError(
                f"budget_tokens ({self.budget_tokens}) must be at least sink_tokens + "
                f"window_tokens ({self.sink_tokens} + {self.window_tokens})"
            )
        if self.buckets < 1 or min(self.sink_tokens, self.window_tokens) < 0:
            raise ValueError("buckets must be >= 1, sink_tokens and window_tokens >= 0")
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


@dataclass
class _Snapshot:
    recurrent: list[torch.Tensor]
    conv: list[torch.Tensor]
    kv_tokens: int
    next_position: int


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
        self._stop_ids = {self.tokenizer.convert_tokens_to_ids(t)
                          for t in ("<|im_end|>", "<|endoftext|>")}
        self._prefix, self._question_template = self._split_chat_template()
        self.reset()

    # ----------------------------------------------------------------------------- streaming
    def reset(self) -> None:
        """Forget everything and open a new stream with the chat prefix (the attention sinks)."""
        self.cache = DynamicCache(config=self.model.config.text_config)
        self.next_position = 0
        self.chunks_seen = 0
        self.slot_time = torch.empty(0, dtype=torch.float64)
        self.slot_score = torch.empty(0, dtype=torch.float32)
        self.slot_chunk = torch.empty(0, dtype=torch.long)
        self.chunk_stamps: dict[int, float | None] = {}
        ids, positions = self.builder.text(self._prefix, 0)
        self._prefill(ids, positions)
        self.next_position = positions.max().item() + 1
        # The chat framing is never evicted: +inf score, stream time 0.
        self._append_slots(ids.shape[1], time_s=0.0, chunk=PREFIX_CHUNK,
                           scores=torch.full((ids.shape[1],), math.inf))

    @torch.inference_mode()
    def add_chunk(
        self, frames: Sequence[np.ndarray], times: Sequence[float], stamp: float | None = None
    ) -> ChunkResult:
        """Ingest one chunk: RGB uint8 frames (H x W x 3) and their stream times in seconds.

        stamp: the chunk's last frame's header stamp (seconds), reported back as evidence.
        """
        chunk = self.builder.build(frames, times, self.next_position)
        self._check_positions(chunk.next_position)

        t0 = self._now()
        before = [s.clone() for s in self._recurrent_states()]
        t1 = self._now()
        strengths: list[torch.Tensor] = []
        with self._recording_write_strength(strengths):
            self._prefill_chunk(chunk)
        t2 = self._now()
        drift, per_layer = state_drift(before, self._recurrent_states())
        del before
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
        self._append_slots(chunk.num_tokens, chunk.time, index, self.policy.score(signals))
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
        """Algorithm 1, lines 6-10. Returns how many slots were evicted."""
        total = self.kv_tokens
        cfg = self.config
        if total <= cfg.budget_tokens:
            return 0
        keep = select_keep(
            self.slot_time, self.slot_score, cfg.budget_tokens, cfg.sink_tokens,
            cfg.window_tokens, self.policy.buckets or cfg.buckets,
        )
        keep_dev = keep.to(self.device)
        for i in self._full:
            layer = self.cache.layers[i]
            layer.keys = layer.keys.index_select(-2, keep_dev)
            layer.values = layer.values.index_select(-2, keep_dev)
        self.slot_time = self.slot_time[keep]
        self.slot_score = self.slot_score[keep]
        self.slot_chunk = self.slot_chunk[keep]
        retained = set(self.slot_chunk.unique().tolist())
        self.chunk_stamps = {c: s for c, s in self.chunk_stamps.items() if c in retained}
        return total - keep.numel()

    def _append_slots(self, n: int, time_s: float, chunk: int, scores: torch.Tensor) -> None:
        self.slot_time = torch.cat([self.slot_time, torch.full((n,), time_s, dtype=torch.float64)])
        self.slot_score = torch.cat([self.slot_score, scores.float().cpu()])
        self.slot_chunk = torch.cat([self.slot_chunk, torch.full((n,), chunk, dtype=torch.long)])

    # ----------------------------------------------------------------------------- asking
    @torch.inference_mode()
    def ask(self, question: str, max_new_tokens: int | None = None) -> Answer:
        """Answer from what the memory holds; the memory is left bit-identical."""
        if not question.strip():
            raise ValueError("the question is empty")
        start = time.perf_counter()
        limit = max_new_tokens or self.config.max_new_tokens
        kv_before = self.kv_tokens
        snapshot = self._snapshot()
        try:
            ids, positions = self._question_ids(question)
            self._check_positions(positions.max().item() + 1 + limit)
            with self._attention_weights() as weights:
                hidden = self._prefill(ids, positions)
            evidence = self._evidence(weights, kv_before)
            generated = self._greedy(hidden, positions.max().item() + 1, limit)
        finally:
            self._restore(snapshot)
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

    def _question_ids(self, question: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens closing the user turn with the question, at the running position.

        The question is tokenized with special tokens split, so a question cannot close the turn
        or inject template markup of its own.
        """
        before, after = self._question_template.split("{question}")
        encode = self.tokenizer.encode
        ids = (encode(before, add_special_tokens=False)
               + encode(question, add_special_tokens=False, split_special_tokens=True)
               + encode(after, add_special_tokens=False))
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
        """Everything a question may change, at fixed size (the KV cache only by its length)."""
        layers = [self.cache.layers[i] for i in self._linear]
        return _Snapshot(
            recurrent=[layer.recurrent_states[0].clone() for layer in layers],
            conv=[layer.conv_states[0].clone() for layer in layers],
            kv_tokens=self.kv_tokens,
            next_position=self.next_position,
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
                f"({self.max_positions}); reset the memory"
            )

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _split_chat_template(self) -> tuple[str, str]:
        """The stream's prefix (opening the user turn) and the question suffix template."""
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": "{question}"}]}],
            tokenize=False, add_generation_prompt=True,
        )
        if rendered.count(VIDEO_MARKER) != 1 or "{question}" not in rendered:
            raise ValueError("the tokenizer's chat template does not place a video in a user turn")
        prefix, suffix = rendered.split(VIDEO_MARKER)
        return prefix, suffix

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
