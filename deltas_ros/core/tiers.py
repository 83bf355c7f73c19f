"""The second tier: tokens the GPU budget lets go wait in host memory, then on disk, for a
question to call them back.

    store = TierStore(host_bytes=2 << 30, disk_bytes=16 << 30, directory=Path("memory/tiers"))
    store.put(piece)          # on eviction: queued, moved by a background writer
    store.flush(timeout=1.0)  # before a question looks
    entries = store.load(store.index().chunks[:3])

A piece is one chunk's evicted slots as they were cached: K/V at every full-attention layer,
their positions, scores, stream time, stamp and pose. Pieces of one chunk (a per-token policy
evicts a chunk over several evictions) merge into one entry. The writer keeps the host tier
under its budget by spilling its oldest entries to disk, and the disk tier under its own by
dropping: among the oldest quarter of the disk entries (by stream time), the lowest mean
retention score goes first. When the writer falls behind, the oldest pending piece is dropped
and counted; putting never blocks the chunk's path.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .config import MemoryConfig
from .poses import Pose
from .recall import key_summary
from .results import TieredChunk
from .slot_table import SlotTable

HOST, DISK = "host", "disk"
MB = 1 << 20
PENDING_PIECES = 64  # pieces waiting for the writer at most (the oldest is dropped beyond it)
OLDEST_PART = 0.25  # share of the disk tier (oldest by time) the drop rule chooses within


@dataclass(frozen=True)
class TierPiece:
    """Slots of one chunk leaving the GPU tier.

    keys, values: (L, H_kv, n, D) at the L full-attention layers, as cached (keys rotated at
    `position`); position: (3, n); score: (n,) the retention scores they had.
    """

    chunk: int
    time_s: float
    keys: torch.Tensor
    values: torch.Tensor
    position: torch.Tensor
    score: torch.Tensor
    stamp: float | None = None
    pose: Pose | None = None

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.keys, self.values, self.position, self.score))

    def merged(self, other: TierPiece) -> TierPiece:
        """This chunk's slots followed by `other`'s (a later eviction of the same chunk)."""
        return replace(self, keys=torch.cat([self.keys, other.keys], 2),
                       values=torch.cat([self.values, other.values], 2),
                       position=torch.cat([self.position, other.position], 1),
                       score=torch.cat([self.score, other.score]))


@dataclass
class _Entry:
    """What the store knows of a tiered chunk; `piece` is None while it lives on disk."""

    chunk: int
    time_s: float
    tokens: int
    nbytes: int
    mean_score: float
    summary: torch.Tensor  # recall.key_summary of its keys, e.g. (L, H_kv, D) float32
    tier: str = HOST
    piece: TierPiece | None = None
    path: Path | None = None


@dataclass(frozen=True)
class TierIndex:
    """Every tiered chunk, oldest first: what recall scores. summaries (C, L, H_kv, D)."""

    chunks: list[int]
    times: torch.Tensor
    tokens: torch.Tensor
    tiers: list[str]
    summaries: torch.Tensor


@dataclass
class TierStats:
    """Each tier's chunks and bytes, and what was lost: pieces the writer could not keep up
    with, and chunks dropped past both budgets."""

    host_chunks: int = 0
    host_bytes: int = 0
    disk_chunks: int = 0
    disk_bytes: int = 0
    dropped_pieces: int = 0
    dropped_chunks: int = 0
    pending: int = 0
    errors: list[str] = field(default_factory=list)


class TierStore:
    """A host tier then a disk tier, filled by one background writer thread."""

    def __init__(self, host_bytes: int, disk_bytes: int = 0, directory: Path | None = None,
                 pending: int = PENDING_PIECES) -> None:
        if host_bytes < 0 or disk_bytes < 0 or pending < 1:
            raise ValueError("tier budgets must be >= 0 and pending >= 1")
        if disk_bytes and directory is None:
            raise ValueError("a disk tier needs a directory")
        self.host_bytes, self.disk_bytes, self.directory = host_bytes, disk_bytes, directory
        # A store starts empty: an earlier run's files would count for nothing and fill the
        # disk past its budget.
        if directory is not None and directory.is_dir():
            for stale in directory.glob("chunk-*.safetensors"):
                stale.unlink()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._pending: deque[TierPiece] = deque()
        self._limit = pending
        self._lock = threading.Condition()
        self._busy = False
        self._closed = False
        self.stats = TierStats()
        # keys (L, H_kv, n, D) -> the chunk's key summary that recall scores (recall.py)
        self.summarize: Callable[[torch.Tensor], torch.Tensor] = key_summary
        self._thread = threading.Thread(target=self._write_loop, name="tier-writer", daemon=True)
        self._thread.start()

    @classmethod
    def for_config(cls, config: MemoryConfig) -> TierStore | None:
        """The store a memory's config asks for; None without a second tier."""
        if not (config.host_budget_mb or config.disk_budget_mb):
            return None
        return cls(int(config.host_budget_mb * MB), int(config.disk_budget_mb * MB),
                   Path(config.tier_dir) if config.tier_dir else None)

    # ------------------------------------------------------------------------ the chunk's side
    def put(self, piece: TierPiece) -> None:
        """Queue a piece for the writer; never blocks. Beyond `pending` pieces the oldest
        waiting one is dropped and counted."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the tier store is closed")
            if len(self._pending) >= self._limit:
                self._pending.popleft()
                self.stats.dropped_pieces += 1
            self._pending.append(piece)
            self._lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued piece is in a tier; False when `timeout` s passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._busy, timeout)

    # --------------------------------------------------------------------- the question's side
    def index(self) -> TierIndex:
        """Every tiered chunk, oldest first, with its key summary."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: (e.time_s, e.chunk))
            summaries = (torch.stack([e.summary for e in entries]) if entries
                         else torch.empty(0, 0, 0, 0))
            return TierIndex([e.chunk for e in entries],
                             torch.tensor([e.time_s for e in entries], dtype=torch.float64),
                             torch.tensor([e.tokens for e in entries], dtype=torch.long),
                             [e.tier for e in entries], summaries)

    def chunks(self) -> list[TieredChunk]:
        """Every tiered chunk, oldest first, with its tokens and tier: for a viewer."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: (e.time_s, e.chunk))
            return [TieredChunk(e.chunk, e.time_s, e.tokens, e.tier) for e in entries]

    def load(self, chunks: list[int]) -> list[TierPiece]:
        """The pieces of `chunks`, from host memory or read back from disk (a file that cannot
        be read raises, naming it)."""
        with self._lock:
            entries = [self._entries[c] for c in chunks]
        return [e.piece if e.piece is not None else _read(e) for e in entries]

    def clear(self) -> None:
        """Forget every tiered chunk and pending piece, and delete the disk tier's files."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy)
            self._pending.clear()
            for entry in self._entries.values():
                if entry.path is not None:
                    entry.path.unlink(missing_ok=True)
            self._entries.clear()
            self.stats = TierStats()

    def close(self) -> None:
        """Stop the writer (pieces still queued are dropped); closing twice is harmless."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()

    def current_stats(self) -> TierStats:
        with self._lock:
            return replace(self.stats, pending=len(self._pending), errors=list(self.stats.errors))

    # ---------------------------------------------------------------------------- the writer
    def _write_loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                piece = self._pending.popleft()
                self._busy = True
            try:
                self._place(piece)
            except Exception as error:  # a disk full or unwritable: counted, the loop goes on
                with self._lock:
                    self.stats.errors = [*self.stats.errors[-9:], f"{type(error).__name__}: "
                                                                  f"{error}"]
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _place(self, piece: TierPiece) -> None:
        """Put a piece in the host tier, merged with what its chunk already has in a tier. Only
        this thread adds or removes entries (`clear` waits for it), so it reads them unlocked."""
        entry = self._entries.get(piece.chunk)
        whole = piece
        if entry is not None:
            whole = (entry.piece if entry.piece is not None else _read(entry)).merged(piece)
        summary = self.summarize(whole.keys)
        with self._lock:
            if entry is not None:
                self._forget(entry)
            entry = _Entry(piece.chunk, whole.time_s, whole.tokens, whole.nbytes,
                           float(whole.score.float().mean()), summary, HOST, whole)
            self._entries[piece.chunk] = entry
            self._count(entry, +1, HOST)
        self._spill()

    def _spill(self) -> None:
        """Host over budget: the oldest host entries go to disk (or are dropped without one);
        disk over budget: the drop rule."""
        while True:
            with self._lock:
                if self.stats.host_bytes <= self.host_bytes:
                    break
                entry = min((e for e in self._entries.values() if e.tier == HOST),
                            key=lambda e: (e.time_s, e.chunk))
                piece = entry.piece
            if self.disk_bytes and entry.nbytes <= self.disk_bytes:
                path = _write(self.directory, piece)
                with self._lock:
                    self._count(entry, -1, HOST)
                    entry.piece, entry.path, entry.tier = None, path, DISK
                    self._count(entry, +1, DISK)
            else:
                with self._lock:
                    self._drop(entry)
        with self._lock:
            while self.stats.disk_bytes > self.disk_bytes:
                self._drop(self._drop_choice())

    def _drop_choice(self) -> _Entry:
        disk = sorted((e for e in self._entries.values() if e.tier == DISK),
                      key=lambda e: (e.time_s, e.chunk))
        oldest = disk[:max(1, int(len(disk) * OLDEST_PART))]
        return min(oldest, key=lambda e: (e.mean_score, e.time_s))

    def _drop(self, entry: _Entry) -> None:
        self._forget(entry)
        self.stats.dropped_chunks += 1

    def _forget(self, entry: _Entry) -> None:
        self._count(entry, -1, entry.tier)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
        del self._entries[entry.chunk]

    def _count(self, entry: _Entry, sign: int, tier: str) -> None:
        if tier == HOST:
            self.stats.host_chunks += sign
            self.stats.host_bytes += sign * entry.nbytes
        else:
            self.stats.disk_chunks += sign
            self.stats.disk_bytes += sign * entry.nbytes


def evicted_pieces(table: SlotTable, slots: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor) -> list[TierPiece]:
    """The pieces of the held chunks among `slots` (n,) of `table`, one per chunk: keys and
    values (L, H_kv, n, D) are those slots' (Backend.gather_kv), in the same order."""
    chunks = table.chunk[slots]
    pieces = []
    for chunk in chunks.unique().tolist():
        rows = (chunks == chunk).nonzero().squeeze(1)
        at = slots[rows]
        pieces.append(TierPiece(chunk, table.chunk_time(chunk), keys[:, :, rows],
                                values[:, :, rows], table.position[:, at], table.score[at],
                                table.stamp(chunk), table.pose(chunk)))
    return pieces


def _write(directory: Path, piece: TierPiece) -> Path:
    """One chunk's file: its tensors in safetensors, its time, stamp and pose in the header."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"chunk-{piece.chunk:08d}.safetensors"
    pose = None if piece.pose is None else [piece.pose.frame_id, list(piece.pose.position),
                                             list(piece.pose.orientation)]
    meta = {"chunk": piece.chunk, "time_s": piece.time_s, "stamp": piece.stamp, "pose": pose}
    save_file({"keys": piece.keys.contiguous(), "values": piece.values.contiguous(),
               "position": piece.position.contiguous(), "score": piece.score.contiguous()},
              str(path), metadata={"piece": json.dumps(meta)})
    return path


def _read(entry: _Entry) -> TierPiece:
    try:
        with safe_open(str(entry.path), "pt") as handle:
            meta = json.loads(handle.metadata()["piece"])
        tensors = load_file(str(entry.path))
        pose = None if meta["pose"] is None else Pose(meta["pose"][0], tuple(meta["pose"][1]),
                                                       tuple(meta["pose"][2]))
        return TierPiece(meta["chunk"], meta["time_s"], tensors["keys"], tensors["values"],
                         tensors["position"], tensors["score"], meta["stamp"], pose)
    except Exception as error:
        raise RuntimeError(f"tier file {entry.path} cannot be read: {error}") from error
