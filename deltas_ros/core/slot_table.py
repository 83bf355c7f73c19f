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

Slots need not sit in arrival order: an eviction fills the holes it leaves with the slots at the
end of the cache (`keep_slots`), since attention does not care where a key sits (it carries its
rotary position). Everything that depends on order (the window, ties, time buckets, position
compaction) reads the slots in `arrival_order()`. eviction_reference.py holds the slow versions
`keep_slots` is tested against (a gather of every kept slot; `fill_plan`).

A table is immutable: append, keep_slots and moved return a new one, so a snapshot of the
memory holds its table by reference and a rollback is one assignment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch

from .policy import EvictionLimits, bucket_of
from .poses import Pose
from .results import Answer, HeldChunk
from .rope import compacted_positions

PREFIX_CHUNK = -1  # chunk index of the chat prefix's slots
MAX_CHUNKS = 2**31  # chunk indices and counters fit a signed 32-bit field
MAX_ARRIVAL = 2**62  # arrival ranks: tokens of a stream, far from int64's end


class ChunkSlots(NamedTuple):
    """One chunk's slots to add (SlotTable.extend): scores (n,), positions (3, n) or (3, 1, n)
    as fed to the model."""
    time_s: float
    chunk: int
    scores: torch.Tensor
    positions: torch.Tensor
    stamp: float | None = None
    pose: Pose | None = None


class Move(NamedTuple):
    """Slots source..source+count-1 copied to slots to..to+count-1 (an eviction's fill)."""
    to: int
    source: int
    count: int


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
        return self.extend([ChunkSlots(time_s, chunk, scores, positions, stamp, pose)])

    def extend(self, chunks: Sequence[ChunkSlots]) -> SlotTable:
        """The table with the chunks' slots added at the end, in order: one copy of the table
        however many chunks (a question's recalled chunks may be hundreds)."""
        if not chunks:
            return self
        positions, scores = [], []
        for c in chunks:
            positions.append(c.positions.reshape(3, -1).long().cpu())
            scores.append(c.scores.float().cpu())
        sizes = [p.shape[1] for p in positions]
        n = sum(sizes)
        held = [c for c in chunks if c.chunk != PREFIX_CHUNK]
        return SlotTable(
            torch.cat([self.time, *(torch.full((k,), c.time_s, dtype=torch.float64)
                                    for c, k in zip(chunks, sizes))]),
            torch.cat([self.score, *scores]),
            torch.cat([self.chunk, *(torch.full((k,), c.chunk, dtype=torch.long)
                                     for c, k in zip(chunks, sizes))]),
            torch.cat([self.position, *positions], 1),
            {**self.stamps, **{c.chunk: None if c.stamp is None else float(c.stamp)
                               for c in held}},
            torch.cat([self.arrival, torch.arange(self.next_arrival, self.next_arrival + n)]),
            self.next_arrival + n,
            {**self.poses, **{c.chunk: c.pose for c in held}},
        )

    def keep_slots(self, kept: torch.Tensor) -> tuple[SlotTable, list[Move]]:
        """The table after only the slots `kept` (any order) stay (policy.select_keep), and the
        moves that make it so: the kept slots at or above the new size fill the evicted ones
        below it, in slot order, as ranges (O(evicted) moves, not a copy of every kept slot)."""
        size = kept.numel()
        keep = np.zeros(len(self), dtype=bool)
        keep[kept.numpy()] = True
        moves = _paired(_ranges(np.flatnonzero(~keep[:size])),
                        _ranges(np.flatnonzero(keep[size:]) + size))
        return self.after_moves(moves, size), moves

    def after_moves(self, moves: Sequence[Move], size: int) -> SlotTable:
        """The table after `moves` and a cut to `size` slots."""
        def moved(row: torch.Tensor) -> torch.Tensor:  # numpy: cheaper than torch for slices
            data = row.numpy()
            out = data[..., :size].copy()
            for to, source, count in moves:
                out[..., to:to + count] = data[..., source:source + count]
            return torch.from_numpy(out)

        chunk = moved(self.chunk)
        stamps, poses = self.held(chunk)
        return SlotTable(moved(self.time), moved(self.score), chunk, moved(self.position),
                         stamps, moved(self.arrival), self.next_arrival, poses)

    def moved(self, positions: torch.Tensor) -> SlotTable:
        """The table with new (3, T) positions (after a compaction)."""
        return replace(self, position=positions)

    def held(self, chunk: torch.Tensor) -> tuple[dict[int, float | None],
                                                 dict[int, Pose | None]]:
        """The stamps and poses of the chunks a new table still holds (its chunk row)."""
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

    def held_chunks(self, limits: EvictionLimits) -> list[HeldChunk]:
        """The held stream chunks, oldest first, each with its slots, the temporal bucket
        its evictable slots (between the sinks and the recent window, in arrival order) fall
        in as the next eviction would see them (-1: all of them are sinks or window) and its
        pose.
        `policy_reference.held_chunks_reference` is the per-chunk loop it is tested against."""
        order = self.arrival_order().numpy()
        chunk, time = self.chunk.numpy()[order], self.time.numpy()[order]
        bucket = np.full(chunk.size, -1, dtype=np.int16)
        lo = min(limits.sinks, chunk.size)
        hi = max(chunk.size - limits.window, lo)
        if hi > lo:
            bucket[lo:hi] = bucket_of(time[lo:hi], limits.buckets)
        stream = chunk >= 0  # a chunk's slots are consecutive in arrival order
        ids, starts, counts = np.unique(chunk[stream], return_index=True, return_counts=True)
        first = np.flatnonzero(stream)[starts]
        top = np.maximum.reduceat(bucket[stream], starts) if ids.size else []
        return [HeldChunk(int(c), float(time[f]), int(n), int(b), self.poses.get(int(c)))
                for c, f, n, b in zip(ids, first, counts, top)]

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

    def answer(self, text: str, evidence: list[int], **fields) -> Answer:
        """The answer `text` with the times, stamps and poses of its `evidence` chunks and the
        span of this table (the memory as the question saw it); `fields`: Answer's others."""
        span_start, span_end = self.span()
        return Answer(text=text, evidence_times=[self.chunk_time(c) for c in evidence],
                      evidence_stamps=[self.stamp(c) for c in evidence],
                      evidence_poses=[self.pose(c) for c in evidence],
                      span_start=span_start, span_end=span_end, **fields)

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


def _ranges(slots: np.ndarray) -> list[tuple[int, int]]:
    """(first, end) ranges of consecutive slots in a sorted slot array."""
    if not slots.size:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts, ends = slots[np.r_[0, breaks]], slots[np.r_[breaks - 1, slots.size - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist()))


def _paired(holes: list[tuple[int, int]], movers: list[tuple[int, int]]) -> list[Move]:
    """Moves that fill the hole ranges with the mover ranges in order (both sorted, as many
    slots each side), splitting ranges where their ends differ: fill_plan's pairing."""
    moves, h, m = [], 0, 0
    hole, mover = (holes[0] if holes else None), (movers[0] if movers else None)
    while hole is not None and mover is not None:  # each pass uses up a hole or a mover range
        count = min(hole[1] - hole[0], mover[1] - mover[0])
        moves.append(Move(hole[0], mover[0], count))
        hole, mover = (hole[0] + count, hole[1]), (mover[0] + count, mover[1])
        if hole[0] == hole[1]:
            h += 1
            hole = holes[h] if h < len(holes) else None
        if mover[0] == mover[1]:
            m += 1
            mover = movers[m] if m < len(movers) else None
    return moves
