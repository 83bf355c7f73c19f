"""One chunk's slots in the second tier, and the file that holds them on disk.

A piece is what an eviction let go of one chunk, as it was cached: K/V at every full-attention
layer, positions, retention scores, stream time, stamp and pose. On disk it is one safetensors
file (tensors keys, values, position, score; the rest as JSON in the header), written to a
fresh name and never changed in place, so another name may link to it (a saved memory does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load, save

from .poses import Pose
from .slot_table import SlotTable

# keys (L, H_kv, n, D) cached at positions p, shift (3, n) -> the keys at p + shift
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TENSORS = ("keys", "values", "position", "score")


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
    shift: int = 0  # positions compactions moved it by since it was cached (see `at_shift`)

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.keys, self.values, self.position, self.score))

    @property
    def first_position(self) -> int:
        """Its first token's T position, its pending shift applied."""
        return int(self.position[0].min()) + self.shift

    def at_shift(self, rotate: Rotate | None) -> TierPiece:
        """This piece with its pending shift applied: keys re-rotated by it and positions
        moved (every row of a token moves by the same shift, as in a compaction)."""
        if not self.shift:
            return self
        if rotate is None:
            raise RuntimeError("a shifted tier piece needs the model's key rotation")
        shift = torch.full_like(self.position, self.shift)
        return replace(self, keys=rotate(self.keys, shift), position=self.position + shift,
                       shift=0)

    def merged(self, other: TierPiece) -> TierPiece:
        """This chunk's slots followed by `other`'s (a later eviction of the same chunk); both
        without a pending shift."""
        return replace(self, keys=torch.cat([self.keys, other.keys], 2),
                       values=torch.cat([self.values, other.values], 2),
                       position=torch.cat([self.position, other.position], 1),
                       score=torch.cat([self.score, other.score]))


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


@dataclass(frozen=True)
class Evicted:
    """One eviction's slots as gathered: split into pieces (`evicted_pieces`) by the tier's
    writer, off the chunk's path. table: the slot table before the eviction (immutable)."""

    table: SlotTable
    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def pieces(self) -> list[TierPiece]:
        return evicted_pieces(self.table, self.slots, self.keys, self.values)


def write_piece(directory: Path, piece: TierPiece) -> tuple[Path, str]:
    """Write `piece` (without its pending shift: the caller keeps that) to a new file in
    `directory`; (its path, the sha256 of its bytes). The file is complete before its name
    appears (written aside, then renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    pose = None if piece.pose is None else piece.pose.to_json()
    meta = {"chunk": piece.chunk, "time_s": piece.time_s, "stamp": piece.stamp, "pose": pose}
    data = save({name: getattr(piece, name).contiguous() for name in TENSORS},
                metadata={"piece": json.dumps(meta)})
    path = piece_path(directory, piece.chunk)
    aside = path.with_suffix(".tmp")
    aside.write_bytes(data)
    os.replace(aside, path)
    return path, hashlib.sha256(data).hexdigest()


def read_piece(path: Path, sha256: str | None = None) -> TierPiece:
    """The piece in `path`; RuntimeError naming the file when it cannot be read, or when its
    bytes do not have `sha256` (when given)."""
    try:
        data = path.read_bytes()
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError("its sha256 differs from the one recorded: altered or damaged")
        tensors = load(data)
        meta = json.loads(_header_metadata(data)["piece"])
        pose = None if meta["pose"] is None else Pose.from_json(meta["pose"])
        return TierPiece(int(meta["chunk"]), float(meta["time_s"]),
                         *(tensors[name] for name in TENSORS), meta["stamp"], pose)
    except Exception as error:
        raise RuntimeError(f"tier file {path} cannot be read: {error}") from error


def piece_path(directory: Path, chunk: int) -> Path:
    """A new name for a file of `chunk` (never one in use: files are not changed in place)."""
    return directory / f"chunk-{chunk:08d}-{uuid.uuid4().hex[:12]}.safetensors"


def link_or_copy(source: Path, target: Path) -> None:
    """The new name `target` for the bytes of `source`: a hard link (nothing copied), or a copy
    (made aside, then renamed) where the two lie on different file systems."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise
    except OSError:
        aside = target.with_suffix(".tmp")
        shutil.copyfile(source, aside)
        os.replace(aside, target)


def _header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes (safetensors.torch.load drops it)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length])["__metadata__"]
