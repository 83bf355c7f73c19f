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
retention score goes first. When the writer falls behind, the oldest pending eviction is dropped
and counted; putting never blocks the chunk's path.

A compaction of the GPU tier's positions (rope.py) moves every tiered chunk too
(`shift_positions`): the shift is recorded and applied, with the keys' re-rotation, when the
chunk is read. A saved memory links its tier's files (`export_files`) and a loaded one adopts
them (`adopt`; tier_saving.py checks them first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .config import MemoryConfig
from .recall import key_summary
from .results import TieredChunk
from .tier_piece import (
    Evicted,
    Rotate,
    TierPiece,
    evicted_pieces,
    link_or_copy,
    piece_path,
    read_piece,
    write_piece,
)

__all__ = ["DISK", "HOST", "Evicted", "TierIndex", "TierPiece", "TierStats", "TierStore",
           "evicted_pieces"]

HOST, DISK = "host", "disk"
MB = 1 << 20
PENDING_PIECES = 64  # items (evictions) waiting for the writer at most (the oldest dropped beyond)
OLDEST_PART = 0.25  # share of the disk tier (oldest by time) the drop rule chooses within


@dataclass
class _Entry:
    """What the store knows of a tiered chunk; `piece` is None while it lives on disk."""

    chunk: int
    time_s: float
    tokens: int
    nbytes: int  # its tensors' bytes in host memory; its file's on disk
    mean_score: float
    summary: torch.Tensor  # recall.key_summary of its keys: (1, H_kv, 4, D) float32 (top-norm)
    first_position: int  # its first token's T position, as it would be read now
    tier: str = HOST
    piece: TierPiece | None = None  # without a pending shift (placed pieces are shifted)
    path: Path | None = None
    sha256: str = ""  # of the disk file's bytes
    shift: int = 0  # compactions since it was placed: applied when it is read (`at_shift`)

    @classmethod
    def of(cls, piece: TierPiece, summary: torch.Tensor, shift: int = 0) -> _Entry:
        """A host entry for `piece` (no pending shift) that reads `shift` positions later."""
        return cls(piece.chunk, piece.time_s, piece.tokens, piece.nbytes,
                   float(piece.score.float().mean()), summary,
                   int(piece.position[0].min()) + shift, HOST, piece, shift=shift)


@dataclass(frozen=True)
class TierIndex:
    """Every tiered chunk, oldest first: what recall scores. summaries (C, L, H_kv, r, D) of
    the store's kind (recall.py; (C, L, H_kv, D) for `mean`)."""

    chunks: list[int]
    times: torch.Tensor
    tokens: torch.Tensor
    tiers: list[str]
    summaries: torch.Tensor


@dataclass
class TierStats:
    """Each tier's chunks and bytes, the host memory their key summaries take (a disk chunk's
    stays in memory for recall, outside both budgets), and what was lost: pieces the writer
    could not keep up with, and chunks dropped past both budgets (each once)."""

    host_chunks: int = 0
    host_bytes: int = 0
    disk_chunks: int = 0
    disk_bytes: int = 0
    dropped_pieces: int = 0
    dropped_chunks: int = 0
    summary_bytes: int = 0  # every tiered chunk's key summary, in host memory whatever its tier
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
            for stale in [*directory.glob("chunk-*.safetensors"), *directory.glob("chunk-*.tmp")]:
                stale.unlink()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._pending: deque[TierPiece | Evicted] = deque()
        self._writing: list[TierPiece | Evicted] = []  # taken by the writer, not yet placed
        self._limit = pending
        self._lock = threading.Condition()
        self._busy = False
        self._closed = False
        self.stats = TierStats()
        self._listed: list[TieredChunk] | None = None  # `chunks()`, until the entries change
        self._indexed: TierIndex | None = None  # `index()`, until the entries change
        # chunks dropped whose later pieces may still come (some of their slots are on the
        # GPU): a chunk is counted dropped once; pruned with every eviction (`_still_held`)
        self._gone: set[int] = set()
        # keys (L, H_kv, n, D) -> the chunk's key summary that recall scores (recall.py): key
        # vectors (..., D) or their means, so a compaction can re-rotate it
        self.summarize: Callable[[torch.Tensor], torch.Tensor] = key_summary
        self.rotate: Rotate | None = None  # the model's key rotation (compactions need it)
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
    def put(self, item: TierPiece | Evicted) -> None:
        """Queue a piece, or an eviction's slots, for the writer; never blocks. Beyond `pending`
        items the oldest waiting one is dropped and its pieces counted."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the tier store is closed")
            if len(self._pending) >= self._limit:
                self.stats.dropped_pieces += _piece_count(self._pending.popleft())
            self._pending.append(item)
            self._lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued piece is in a tier; False when `timeout` s passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._busy, timeout)

    # --------------------------------------------------------------------- the question's side
    def index(self) -> TierIndex:
        """Every tiered chunk, oldest first, with its key summary (stacked again only after
        the entries changed: a question reads it, and an hour holds thousands)."""
        with self._lock:
            if self._indexed is None:
                entries = sorted(self._entries.values(), key=lambda e: (e.time_s, e.chunk))
                summaries = (torch.stack([e.summary for e in entries]) if entries
                             else torch.empty(0, 0, 0, 0))
                self._indexed = TierIndex(
                    [e.chunk for e in entries],
                    torch.tensor([e.time_s for e in entries], dtype=torch.float64),
                    torch.tensor([e.tokens for e in entries], dtype=torch.long),
                    [e.tier for e in entries], summaries)
            return self._indexed

    def chunks(self) -> list[TieredChunk]:
        """Every tiered chunk, oldest first, with its tokens and tier: for a viewer (read after
        every chunk, so sorted again only after the entries changed). What is on its way to
        the writer counts too, in the tier it goes to first: an eviction is listed from the
        moment it leaves the GPU tier, never missing from both."""
        with self._lock:
            if self._listed is None:
                entries = sorted(self._entries.values(), key=lambda e: (e.time_s, e.chunk))
                self._listed = [TieredChunk(e.chunk, e.time_s, e.tokens, e.tier)
                                for e in entries]
            listed, coming = self._listed, [*self._writing, *self._pending]
        if not coming:
            return list(listed)
        return _with_coming(listed, coming, HOST if self.host_bytes else DISK)

    def load(self, chunks: list[int]) -> list[TierPiece]:
        """The pieces of `chunks` at their current positions, from host memory or read back
        from disk (a file that cannot be read raises, naming it)."""
        with self._lock:
            entries = [self._entries[c] for c in chunks]
        return [self._read(e) for e in entries]

    def shift_positions(self, shift_of: Callable[[int], int]) -> None:
        """A compaction moved the GPU tier's positions: every tiered chunk (and pending piece)
        moves by shift_of(its first T position), read lazily; summaries re-rotate now."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy)
            for entry in self._entries.values():
                if shift := shift_of(entry.first_position):
                    entry.shift += shift
                    entry.first_position += shift
                    entry.summary = _rotated(self.rotate, entry.summary, shift)
                    self._indexed = None
            self._pending = deque(replace(p, shift=p.shift + shift_of(p.first_position))
                                  for item in self._pending for p in _pieces(item))

    def export_files(self, directory: Path, timeout: float) -> list[dict]:
        """Every tiered chunk as a file in `directory` (a disk tier's file is linked, not
        copied; a host tier's is written) and what a memory file records of each: chunk, file
        name, sha256, tokens, time_s and the pending shift. RuntimeError when the writer does
        not place what is queued within `timeout` s."""
        if not self.flush(timeout):
            raise RuntimeError(f"the tier writer did not finish within {timeout} s")
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: (e.time_s, e.chunk))
        records = []
        for entry in entries:
            if entry.piece is not None:
                path, sha256 = write_piece(directory, entry.piece)
            else:
                path, sha256 = piece_path(directory, entry.chunk), entry.sha256
                link_or_copy(entry.path, path)
            records.append({"chunk": entry.chunk, "file": path.name, "sha256": sha256,
                            "tokens": entry.tokens, "time_s": entry.time_s,
                            "shift": entry.shift})
        return records

    def loaded_entry(self, piece: TierPiece, path: Path, sha256: str) -> _Entry:
        """What `adopt` takes for a saved chunk's checked file (piece: its contents with the
        shift recorded beside it): its summary now, its tensors only where no disk tier will
        link the file."""
        entry = _Entry.of(replace(piece, shift=0),
                          _rotated(self.rotate, self.summarize(piece.keys), piece.shift),
                          piece.shift)
        if self.disk_bytes:
            entry.piece, entry.path, entry.tier, entry.sha256 = None, path, DISK, sha256
            entry.nbytes = path.stat().st_size
        return entry

    def linked(self, entries: list[_Entry]) -> list[_Entry]:
        """A loaded memory's `entries` (`loaded_entry`) with their files linked into the disk
        tier under new names, for `adopt`; the store is unchanged (on failure too)."""
        done: list[_Entry] = []
        try:
            for entry in entries:
                if entry.path is not None:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    target = piece_path(self.directory, entry.chunk)
                    link_or_copy(entry.path, target)
                    entry = replace(entry, path=target)
                done.append(entry)
        except BaseException:
            self.unlink(done)
            raise
        return done

    @staticmethod
    def unlink(entries: list[_Entry]) -> None:
        """Delete the files of `linked` entries that were not adopted."""
        for entry in entries:
            if entry.path is not None:
                entry.path.unlink(missing_ok=True)

    def adopt(self, entries: list[_Entry]) -> None:
        """Replace every tiered chunk with `linked` entries of a loaded memory; then the
        budgets apply (what is over them is dropped and counted)."""
        self.clear()
        with self._lock:
            self._busy = True  # the writer keeps off while the entries change
            for entry in entries:
                self._entries[entry.chunk] = entry
                self._count(entry, +1, entry.tier)
        try:
            self._spill()
        finally:
            with self._lock:
                self._busy = False
                self._lock.notify_all()

    def clear(self) -> None:
        """Forget every tiered chunk and pending piece, and delete the disk tier's files."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy)
            self._pending.clear()
            for entry in self._entries.values():
                if entry.path is not None:
                    entry.path.unlink(missing_ok=True)
            self._entries.clear()
            self._gone.clear()
            self._listed = self._indexed = None
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
                item = self._pending.popleft()
                self._writing = [item]
                self._busy = True
            try:
                pieces = _pieces(item)
                with self._lock:
                    self._writing = list(pieces)
                for k, piece in enumerate(pieces):
                    self._place(piece, pieces[k + 1:])
                if isinstance(item, Evicted):
                    with self._lock:
                        self._gone &= _still_held(item)
            except Exception as error:  # a disk full or unwritable: counted, the loop goes on
                with self._lock:
                    self.stats.errors = [*self.stats.errors[-9:], f"{type(error).__name__}: "
                                                                  f"{error}"]
            finally:
                with self._lock:
                    self._busy, self._writing = False, []
                    self._lock.notify_all()

    def _place(self, piece: TierPiece, after: list[TierPiece]) -> None:
        """Put a piece in the host tier, merged with what its chunk already has in a tier;
        `after`: the item's pieces still to place. Only this thread adds or removes entries
        while it is busy (the others wait for it), so it reads them unlocked."""
        whole = piece.at_shift(self.rotate)
        if (entry := self._entries.get(piece.chunk)) is not None:
            whole = self._read(entry).merged(whole)
        summary = self.summarize(whole.keys)
        with self._lock:
            if entry is not None:
                self._forget(entry)
            entry = self._entries[piece.chunk] = _Entry.of(whole, summary)
            self._count(entry, +1, HOST)
            self._writing = after
        self._spill()

    def _read(self, entry: _Entry) -> TierPiece:
        """The entry's piece at its current positions (its file read back when on disk)."""
        piece = entry.piece if entry.piece is not None else read_piece(entry.path)
        return replace(piece, shift=entry.shift).at_shift(self.rotate)

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
                path, sha256 = write_piece(self.directory, piece)
                with self._lock:
                    self._count(entry, -1, HOST)
                    entry.piece, entry.path, entry.tier, entry.sha256 = None, path, DISK, sha256
                    entry.nbytes = path.stat().st_size  # the disk budget counts whole files
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
        if entry.chunk not in self._gone:
            self.stats.dropped_chunks += 1
            self._gone.add(entry.chunk)

    def _forget(self, entry: _Entry) -> None:
        self._count(entry, -1, entry.tier)
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
        del self._entries[entry.chunk]

    def _count(self, entry: _Entry, sign: int, tier: str) -> None:
        """Count an entry in or out of a tier: every change of the entries passes here."""
        self._listed = self._indexed = None
        self.stats.summary_bytes += sign * entry.summary.numel() * entry.summary.element_size()
        if tier == HOST:
            self.stats.host_chunks += sign
            self.stats.host_bytes += sign * entry.nbytes
        else:
            self.stats.disk_chunks += sign
            self.stats.disk_bytes += sign * entry.nbytes


def _rotated(rotate: Rotate | None, summary: torch.Tensor, shift: int) -> torch.Tensor:
    """A key summary (L, H_kv, ..., D) as the keys it summarises would be `shift` positions
    later (a rotation is linear, so a mean of keys rotates as they do)."""
    if not shift:
        return summary
    if rotate is None:
        raise RuntimeError("a compaction of tiered chunks needs the model's key rotation")
    layers, heads, dim = summary.shape[0], summary.shape[1], summary.shape[-1]
    flat = summary.reshape(layers, heads, -1, dim)
    moved = rotate(flat, torch.full((3, flat.shape[2]), shift, dtype=torch.long))
    return moved.reshape(summary.shape)


def _pieces(item: TierPiece | Evicted) -> list[TierPiece]:
    return item.pieces() if isinstance(item, Evicted) else [item]


def _with_coming(listed: list[TieredChunk], coming: list[TierPiece | Evicted],
                 tier: str) -> list[TieredChunk]:
    """`listed` with the chunks of the queued items added (their tokens to a listed chunk's,
    a new chunk in `tier`), oldest first. An eviction's chunks are counted off its slot table,
    without splitting its K/V."""
    by_index = {c.index: c for c in listed}
    for item in coming:
        if isinstance(item, Evicted):
            ids, counts = item.table.chunk[item.slots].unique(return_counts=True)
            arrivals = [(c, item.table.chunk_time(c), n)
                        for c, n in zip(ids.tolist(), counts.tolist())]
        else:
            arrivals = [(item.chunk, item.time_s, item.tokens)]
        for index, time_s, tokens in arrivals:
            known = by_index.get(index)
            by_index[index] = (TieredChunk(index, time_s, tokens, tier) if known is None
                               else known._replace(tokens=known.tokens + tokens))
    return sorted(by_index.values(), key=lambda c: (c.time, c.index))


def _still_held(evicted: Evicted) -> set[int]:
    """The chunks with slots on the GPU after the eviction: the only ones more pieces can
    come from."""
    kept = torch.ones(len(evicted.table), dtype=torch.bool)
    kept[evicted.slots] = False
    return set(evicted.table.chunk[kept].tolist())


def _piece_count(item: TierPiece | Evicted) -> int:
    return item.table.chunk[item.slots].unique().numel() if isinstance(item, Evicted) else 1
