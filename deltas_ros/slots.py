"""The slot table: what the memory knows about each KV cache slot, in cache order.

One row per slot of every full-attention layer (all layers hold the same slots):

    time      (T,)   float64  stream time of the slot's chunk (non-decreasing along the slots)
    score     (T,)   float32  retention score (+inf for the chat prefix, never evicted)
    chunk     (T,)   int64    index of the slot's chunk (PREFIX_CHUNK for the chat prefix)
    position  (3, T) int64    T/H/W rotary position the slot's key was rotated at
    arrival   (T,)   int64    arrival rank of the slot's token in the stream (unique, increasing
                              as tokens arrive)
    stamps    {chunk: header stamp or None} of the chunks still held
    poses     {chunk: robot pose at its stamp or None} of the chunks still held (poses.Pose)

Slots need not sit in arrival order: an eviction may fill the holes it leaves with the slots at
the end of the cache (`fill`), since attention does not care where a key sits (it carries its
rotary position). Everything that depends on order (the window, ties, time buckets, position
compaction) reads the slots in `arrival_order()`; `select` keeps the gather path's order.

A table is immutable: append, select, fill and move return a new one, so a snapshot of the memory
holds its table by reference and a rollback is one assignment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .poses import Pose
from .rope import compacted_positions

PREFIX_CHUNK = -1  # chunk index of the chat prefix's slots
MAX_CHUNKS = 2**31  # chunk indices and counters fit a signed 32-bit field
MAX_ARRIVAL = 2**62  # arrival ranks: tokens of a stream, far from int64's end


@dataclass(frozen=True)
class SlotTable:
    """Per-slot time, score, chunk and position, plus the header stamps of the held chunks."""

    time: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    score: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float32))
    chunk: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    position: torch.Tensor = field(default_factory=lambda: torch.empty(3, 0, dtype=torch.long))
    stamps: dict[int, float | None] = field(default_factory=dict)
    arrival: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    next_arrival: int = 0
    poses: dict[int, Pose | None] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.time.numel()

    def append(self, time_s: float, chunk: int, scores: torch.Tensor, positions: torch.Tensor,
               stamp: float | None = None, pose: Pose | None = None) -> SlotTable:
        """The table with one chunk's slots added at the end.

        scores: (n,) one per slot; positions: (3, n) or (3, 1, n) as fed to the model.
        """
        positions = positions.reshape(3, -1).long().cpu()
        n = positions.shape[1]
        stamp = None if stamp is None else float(stamp)
        stamps = self.stamps if chunk == PREFIX_CHUNK else {**self.stamps, chunk: stamp}
        poses = self.poses if chunk == PREFIX_CHUNK else {**self.poses, chunk: pose}
        return SlotTable(
            torch.cat([self.time, torch.full((n,), time_s, dtype=torch.float64)]),
            torch.cat([self.score, scores.float().cpu()]),
            torch.cat([self.chunk, torch.full((n,), chunk, dtype=torch.long)]),
            torch.cat([self.position, positions], 1),
            stamps,
            torch.cat([self.arrival, torch.arange(self.next_arrival, self.next_arrival + n)]),
            self.next_arrival + n,
            poses,
        )

    def select(self, keep: torch.Tensor) -> SlotTable:
        """The table of the slots `keep` (sorted slot indices); stamps of dropped chunks go."""
        keep = keep.cpu()
        chunk = self.chunk[keep]
        stamps, poses = self._held(chunk)
        return SlotTable(self.time[keep], self.score[keep], chunk, self.position[:, keep],
                         stamps, self.arrival[keep], self.next_arrival, poses)

    def fill(self, holes: torch.Tensor, movers: torch.Tensor, size: int) -> SlotTable:
        """The table after the slots `movers` moved into `holes` and the cache was cut to
        `size` slots (see `fill_plan`). In numpy, like the selection (policy.select_keep)."""
        holes, movers = np.asarray(holes), np.asarray(movers)

        def moved(row: torch.Tensor) -> torch.Tensor:  # one copy, one scatter
            data = row.numpy()
            out = data[..., :size].copy()
            out[..., holes] = data[..., movers]
            return torch.from_numpy(out)

        chunk = moved(self.chunk)
        stamps, poses = self._held(chunk)
        return SlotTable(moved(self.time), moved(self.score), chunk, moved(self.position),
                         stamps, moved(self.arrival), self.next_arrival, poses)

    def moved(self, positions: torch.Tensor) -> SlotTable:
        """The table with new (3, T) positions (after a compaction)."""
        return replace(self, position=positions)

    def _held(self, chunk: torch.Tensor) -> tuple[dict[int, float | None],
                                                  dict[int, Pose | None]]:
        """The stamps and poses of the chunks `chunk` (a new table's chunk row) still holds."""
        held = set(np.unique(chunk.numpy()).tolist())
        return ({c: s for c, s in self.stamps.items() if c in held},
                {c: p for c, p in self.poses.items() if c in held})

    def arrival_order(self) -> torch.Tensor:
        """(T,) slot indices in arrival order (the identity while no eviction filled holes)."""
        arrival = self.arrival.numpy()
        if arrival.size < 2 or bool((arrival[1:] > arrival[:-1]).all()):
            return torch.arange(len(self))
        return torch.from_numpy(arrival.argsort(kind="stable"))

    def compacted(self) -> tuple[torch.Tensor, int]:
        """(3, T) gap-free positions per slot, laid out in arrival order (rope.py), and the
        position after them."""
        order = self.arrival_order()
        arrived, end = compacted_positions(self.position[:, order])
        return torch.empty_like(arrived).index_copy_(1, order, arrived), end

    # ----------------------------------------------------------------------------- reading
    def retained_chunks(self) -> list[int]:
        """Indices of the stream chunks with at least one slot held, oldest first."""
        return self.chunk[self.chunk >= 0].unique().tolist()

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

    def pose(self, chunk: int) -> Pose | None:
        return self.poses.get(chunk)

    # ----------------------------------------------------------------------------- persistence
    def export(self) -> dict[str, torch.Tensor]:
        """The tensors a memory file stores, by name (the stamps travel as metadata)."""
        return {"slots.time": self.time, "slots.score": self.score, "slots.chunk": self.chunk,
                "slots.position": self.position, "slots.arrival": self.arrival}

    @classmethod
    def from_export(cls, tensors: dict[str, torch.Tensor], stamps: dict[int, float | None],
                    chunks_seen: int, next_position: int,
                    poses: dict[int, Pose | None] | None = None) -> SlotTable:
        """A table from `export()` tensors, or ValueError saying what is inconsistent."""
        arrival = tensors["slots.arrival"].clone()
        table = cls(tensors["slots.time"].clone(), tensors["slots.score"].clone(),
                    tensors["slots.chunk"].clone(), tensors["slots.position"].clone(),
                    dict(stamps), arrival, int(arrival.max()) + 1 if arrival.numel() else 0,
                    dict(poses or {}))
        table.check(chunks_seen, next_position)
        return table

    def check(self, chunks_seen: int, next_position: int) -> None:
        """ValueError unless the table is one a stream of `chunks_seen` chunks could hold."""
        n = len(self)
        kinds = ((self.time, torch.float64, (n,)), (self.score, torch.float32, (n,)),
                 (self.chunk, torch.long, (n,)), (self.position, torch.long, (3, n)),
                 (self.arrival, torch.long, (n,)))
        if any(t.dtype != dtype or tuple(t.shape) != shape for t, dtype, shape in kinds):
            raise ValueError("slot tensors of mismatched dtypes or sizes")
        if not n:
            raise ValueError("the state holds no slots, not even the chat prefix")
        if (self.arrival.min() < 0 or self.arrival.max() >= MAX_ARRIVAL
                or self.arrival.unique().numel() != n):
            raise ValueError("slot arrival ranks must be distinct, in [0, 2^62)")
        order = self.arrival_order()
        if not torch.isfinite(self.time).all() or (self.time[order].diff() < 0).any():
            raise ValueError("slot times must be finite and never decrease in arrival order")
        if self.score.isnan().any():
            raise ValueError("slot scores must not be NaN")
        if self.chunk.min() < PREFIX_CHUNK or (self.chunk[order].diff() < 0).any():
            raise ValueError("slot chunks must be >= -1 and never decrease in arrival order")
        if self.position.min() < 0 or self.position.max() >= next_position:
            raise ValueError(f"slot positions outside [0, next_position {next_position})")
        if self.chunk.max() >= chunks_seen or any(
                not 0 <= c < chunks_seen for c in self.stamps):
            raise ValueError(f"chunk indices beyond the {chunks_seen} chunks seen")
        if any(s is not None and (not isinstance(s, float) or not math.isfinite(s))
               for s in self.stamps.values()):
            raise ValueError("chunk stamps must be finite floats or None")
        if any(not 0 <= c < chunks_seen for c in self.poses) or any(
                p is not None and not isinstance(p, Pose) for p in self.poses.values()):
            raise ValueError("chunk poses must be Pose or None, of chunks seen")


def fill_plan(kept: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(holes, movers) for keeping slots `kept` of `total` by moving as few as possible.

    The cache shrinks to size = len(kept) slots; the evicted slots below `size` are holes, and
    the kept slots at or above `size` (as many) move into them: O(evicted) moves instead of
    gathering every kept slot. Both are sorted (T,) int64 host index tensors of equal length.
    """
    size = kept.numel()
    keep = np.zeros(total, dtype=bool)
    keep[kept.numpy()] = True
    holes = np.flatnonzero(~keep[:size])
    movers = np.flatnonzero(keep[size:]) + size
    return torch.from_numpy(holes), torch.from_numpy(movers)
