"""What the streaming memory reports: per chunk, per question, its size, its whole state."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

from .poses import Pose

if TYPE_CHECKING:  # plain data: offline runs read and write these without torch
    import torch

    from .frames import SampledChunk


@dataclass
class ChunkFigures:
    """What one chunk did to the memory, with its cost in milliseconds: the figures the engine's
    `ChunkResult` and the stream's `DriftRecord` both report."""

    drift: float
    layer_drift: list[float]
    chunk_tokens: int
    kv_tokens: int
    evicted_tokens: int
    forward_ms: float
    signal_ms: float
    evict_ms: float


@dataclass
class _ResultKey:
    index: int
    time: float


@dataclass
class _RecordKey:
    chunk_index: int  # the sampler's index, as the node publishes it
    stream_time: float
    stamp: float  # header stamp of the chunk's last frame


# A dataclass takes its bases' fields from the last base to the first: each report's key comes
# first, then the figures, then its own fields (the order of DriftRecord's columns).
@dataclass
class ChunkResult(ChunkFigures, _ResultKey):
    """What one chunk did to the memory, with its cost in milliseconds."""

    stamp: float | None = None
    positions_freed: int = 0  # by a position compaction just before this chunk
    pose: Pose | None = None  # the robot's pose at `stamp`, when known


@dataclass
class DriftRecord(ChunkFigures, _RecordKey):
    """One processed chunk as the stream reports it: the fields the node publishes on ~/drift
    (DriftScore) and offline runs write, one per line."""

    @classmethod
    def from_result(cls, chunk: SampledChunk, result: ChunkResult) -> DriftRecord:
        """The record of `result`, numbered and stamped by the sampler's `chunk`."""
        figures = {f.name: getattr(result, f.name) for f in fields(ChunkFigures)}
        figures["layer_drift"] = [float(x) for x in result.layer_drift]
        return cls(chunk.index, result.time, chunk.stamps[-1], **figures)


@dataclass
class Answer:
    """A question's answer and where in the retained stream it looked.

    truncated: the answer stopped at `max_question_s`, not at its end or its token limit.
    cancelled: the caller cancelled it; `text` is the answer so far.
    reasoning: what the model wrote in its reasoning block before `text` (MemoryConfig.thinking;
    "" without one). A block still open when generation stopped leaves `text` empty.
    evidence_poses: the robot pose at each evidence chunk's stamp (None where unknown).
    recalled_chunks, recalled_from_disk: chunks the question called back from the second tier
    (MemoryConfig.recall_tokens), and how many of them were read from disk; recalled_times their
    stream times, oldest first.
    """

    text: str
    evidence_times: list[float]
    evidence_stamps: list[float | None]
    memory_tokens: int
    span_start: float
    span_end: float
    latency_ms: float
    generated_tokens: int
    truncated: bool = False
    cancelled: bool = False
    evidence_poses: list[Pose | None] = field(default_factory=list)
    reasoning: str = ""
    recalled_chunks: int = 0
    recalled_from_disk: int = 0
    recalled_times: list[float] = field(default_factory=list)


class HeldChunk(NamedTuple):
    """A chunk the memory holds: for a viewer of the memory (~/memory_chunks, the dashboard)."""

    index: int
    time: float
    tokens: int  # its slots still in the cache (fewer than it brought once it was thinned)
    bucket: int  # the temporal bucket its evictable slots compete in; -1: none (recent window)
    pose: Pose | None = None  # the robot's pose at its stamp, when known (~/memory_markers)


class TieredChunk(NamedTuple):
    """A chunk (or the part of it) the GPU budget let go, waiting in the second tier."""

    index: int
    time: float
    tokens: int  # its slots in the second tier
    tier: str  # "host" or "disk"


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
    held: list[HeldChunk] = field(default_factory=list)  # the retained chunks, oldest first
    compactions: int = 0
    tiered: list[TieredChunk] = field(default_factory=list)  # the second tier, oldest first

    @property
    def retained_chunks(self) -> list[int]:
        """Indices of the held chunks, oldest first."""
        return [h.index for h in self.held]


@dataclass
class MemoryState:
    """Everything a stream continues from: what persistence.py writes and reads.

    tensors, by name (i: the model's layer index; T: cache slots):
        layers.{i}.recurrent_state  (B, Hv, dk, dv) float32    linear-attention layers
        layers.{i}.conv_state       (B, conv_channels, kernel)  linear-attention layers
        layers.{i}.keys, .values    (B, kv_heads, T, head_dim)  full-attention layers, keys rotated
        slots.time (T,) float64, slots.score (T,) float32, slots.chunk (T,) int64,
        slots.position (3, T) int64   (see slot_table.SlotTable)
    """

    tensors: dict[str, torch.Tensor]
    next_position: int
    chunks_seen: int
    compactions: int
    chunk_stamps: dict[int, float | None]
    chunk_poses: dict[int, Pose | None] = field(default_factory=dict)
