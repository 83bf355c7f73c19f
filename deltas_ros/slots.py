"""The slot table: what the memory knows about each KV cache slot, in cache order.

One row per slot of every full-attention layer (all layers hold the same slots):

    time      (T,)   float64  stream time of the slot's chunk (non-decreasing along the slots)
    score     (T,)   float32  retention score (+inf for the chat prefix, never evicted)
    chunk     (T,)   int64    index of the slot's chunk (PREFIX_CHUNK for the chat prefix)
    position  (3, T) int64    T/H/W rotary position the slot's key was rotated at
    stamps    {chunk: header stamp or None} of the chunks still held

A table is immutable: append, select and move return a new one, so a snapshot of the memory
holds its table by reference and a rollback is one assignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PREFIX_CHUNK = -1  # chunk index of the chat prefix's slots
MAX_CHUNKS = 2**31  # chunk indices and counters fit a signed 32-bit field


@dataclass(frozen=True)
class SlotTable:
    """Per-slot time, score, chunk and position, plus the header stamps of the held chunks."""

    time: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    score: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float32))
    chunk: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    position: torch.Tensor = field(default_factory=lambda: torch.empty(3, 0, dtype=torch.long))
    stamps: dict[int, float | None] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.time.numel()

    def append(self, time_s: float, chunk: int, scores: torch.Tensor, positions: torch.Tensor,
               stamp: float | None = None) -> SlotTable:
        """The table with one chunk's slots added at the end.

        scores: (n,) one per slot; positions: (3, n) or (3, 1, n) as fed to the model.
        """
        positions = positions.reshape(3, -1).long().cpu()
        n = positions.shape[1]
        stamp = None if stamp is None else float(stamp)
        stamps = self.stamps if chunk == PREFIX_CHUNK else {**self.stamps, chunk: stamp}
        return SlotTable(
            torch.cat([self.time, torch.full((n,), time_s, dtype=torch.float64)]),
            torch.cat([self.score, scores.float().cpu()]),
            torch.cat([self.chunk, torch.full((n,), chunk, dtype=torch.long)]),
            torch.cat([self.position, positions], 1),
            stamps,
        )

    def select(self, keep: torch.Tensor) -> SlotTable:
        """The table of the slots `keep` (sorted slot indices); stamps of dropped chunks go."""
        keep = keep.cpu()
        chunk = self.chunk[keep]
        held = set(chunk.unique_consecutive().tolist())  # chunks never decrease along slots
        return SlotTable(self.time[keep], self.score[keep], chunk, self.position[:, keep],
                         {c: s for c, s in self.stamps.items() if c in held})

    def moved(self, positions: torch.Tensor) -> SlotTable:
        """The table with new (3, T) positions (after a compaction)."""
        return SlotTable(self.time, self.score, self.chunk, positions, self.stamps)

    # ----------------------------------------------------------------------------- reading
    def retained_chunks(self) -> list[int]:
        """Indices of the stream chunks with at least one slot held, oldest first."""
        return self.chunk[self.chunk >= 0].unique_consecutive().tolist()

    def chunk_time(self, chunk: int) -> float:
        return self.time[self.chunk == chunk][0].item()

    def chunk_tokens(self, chunk: int) -> int:
        return int((self.chunk == chunk).sum())

    def span(self) -> tuple[float, float]:
        """Stream time of the oldest and newest held chunk (0, 0 when none is held)."""
        times = self.time[self.chunk >= 0]
        return (times.min().item(), times.max().item()) if times.numel() else (0.0, 0.0)

    def stamp(self, chunk: int) -> float | None:
        return self.stamps.get(chunk)

    # ----------------------------------------------------------------------------- persistence
    def export(self) -> dict[str, torch.Tensor]:
        """The tensors a memory file stores, by name (the stamps travel as metadata)."""
        return {"slots.time": self.time, "slots.score": self.score, "slots.chunk": self.chunk,
                "slots.position": self.position}

    @classmethod
    def from_export(cls, tensors: dict[str, torch.Tensor], stamps: dict[int, float | None],
                    chunks_seen: int, next_position: int) -> SlotTable:
        """A table from `export()` tensors, or ValueError saying what is inconsistent."""
        table = cls(tensors["slots.time"].clone(), tensors["slots.score"].clone(),
                    tensors["slots.chunk"].clone(), tensors["slots.position"].clone(),
                    dict(stamps))
        table.check(chunks_seen, next_position)
        return table

    def check(self, chunks_seen: int, next_position: int) -> None:
        """ValueError unless the table is one a stream of `chunks_seen` chunks could hold."""
        n = len(self)
        kinds = ((self.time, torch.float64, (n,)), (self.score, torch.float32, (n,)),
                 (self.chunk, torch.long, (n,)), (self.position, torch.long, (3, n)))
        if any(t.dtype != dtype or tuple(t.shape) != shape for t, dtype, shape in kinds):
            raise ValueError("slot tensors of mismatched dtypes or sizes")
        if not n:
            raise ValueError("the state holds no slots, not even the chat prefix")
        if not torch.isfinite(self.time).all() or (self.time.diff() < 0).any():
            raise ValueError("slot times must be finite and never decrease along the slots")
        if self.score.isnan().any():
            raise ValueError("slot scores must not be NaN")
        if self.chunk.min() < PREFIX_CHUNK or (self.chunk.diff() < 0).any():
            raise ValueError("slot chunks must be >= -1 and never decrease along the slots")
        if self.position.min() < 0 or self.position.max() >= next_position:
            raise ValueError(f"slot positions outside [0, next_position {next_position})")
        if self.chunk.max() >= chunks_seen or any(
                not 0 <= c < chunks_seen for c in self.stamps):
            raise ValueError(f"chunk indices beyond the {chunks_seen} chunks seen")
        if any(s is not None and (not isinstance(s, float) or not math.isfinite(s))
               for s in self.stamps.values()):
            raise ValueError("chunk stamps must be finite floats or None")
