"""A saved memory's second tier: its chunks' files beside the memory file, checked on load.

    memory.safetensors                    the memory file (persistence.py); its metadata lists
                                          every tiered chunk: file name, sha256, tokens, time
    memory.safetensors.tiers-<token>/     one file per tiered chunk (tier_piece.py)

Saving links the disk tier's files into that folder (hard links: nothing is copied, and the
store may drop or replace its own names without touching the saved ones) and writes the host
tier's. Each save makes a new folder and removes the older ones only after the memory file is
in place, so a crash leaves a memory file with the folder it names. Loading reads every file
and checks it against its sha256 and the model's cache layout before the memory changes.
"""

from __future__ import annotations

import math
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .memory import StreamingMemory
from .tier_piece import TierPiece, read_piece

TIER_SAVE_S = 60.0  # how long saving waits for the tier writer to place what is queued
_RECORD = {"chunk": int, "file": str, "sha256": str, "tokens": int, "time_s": (int, float),
           "shift": int}


def tier_folder(path: Path, token: str) -> Path:
    return path.parent / f"{path.name}.tiers-{token}"


def save_tiers(memory: StreamingMemory, path: Path) -> dict[str, Any] | None:
    """Write the memory's tiered chunks into a new folder beside the memory file `path`; what
    the memory file records of them ({"folder": name, "chunks": [records]}), or None without
    a second tier. The caller removes the folder if the memory file is not written."""
    if memory.tiers is None:
        return None
    folder = tier_folder(path, uuid.uuid4().hex[:12])
    try:
        records = memory.tiers.export_files(folder, TIER_SAVE_S)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return {"folder": folder.name, "chunks": records}


def remove_tier_folders(path: Path, keep: str | None) -> None:
    """Remove the tier folders of earlier saves to `path`, all but `keep`."""
    for folder in path.parent.glob(f"{path.name}.tiers-*"):
        if folder.name != keep and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)


def malformed_tiers(tiers: Any, chunks_seen: int) -> list[str]:
    """The metadata fields of a memory file's `tiers` entry that are malformed."""
    if not isinstance(tiers, dict) or not _plain_name(tiers.get("folder")) \
            or not isinstance(tiers.get("chunks"), list):
        return ["tiers"]
    bad = []
    for i, record in enumerate(tiers["chunks"]):
        if not isinstance(record, dict) or any(
                not isinstance(record.get(k), kind) or isinstance(record.get(k), bool)
                for k, kind in _RECORD.items()):
            bad.append(f"tiers.chunks[{i}]")
        elif not (0 <= record["chunk"] < chunks_seen and record["tokens"] > 0
                  and math.isfinite(record["time_s"]) and _plain_name(record["file"])
                  and len(record["sha256"]) == 64):
            bad.append(f"tiers.chunks[{i}]")
    return bad


def check_tiers(memory: StreamingMemory, tiers: dict[str, Any] | None, path: Path) -> list:
    """The entries `TierStore.adopt` takes for the saved tier `tiers` of the memory file
    `path` (empty without one), every file read and checked first; ValueError naming the file
    and the reason for the first one that is missing, altered or not this model's."""
    records = [] if tiers is None else tiers["chunks"]
    if records and memory.tiers is None:
        raise ValueError(f"{path} holds {len(records)} tiered chunks, and this memory has no "
                         f"second tier (host_budget_mb, disk_budget_mb)")
    if memory.tiers is None:
        return []
    layout = _cache_layout(memory)
    entries = []
    for record in records:
        file = path.parent / tiers["folder"] / record["file"]
        try:
            piece = read_piece(file, record["sha256"])
        except RuntimeError as error:
            raise ValueError(str(error)) from error
        if (problem := _problem(piece, record, layout)) is not None:
            raise ValueError(f"tier file {file}: {problem}")
        entries.append(memory.tiers.loaded_entry(replace(piece, shift=record["shift"]), file,
                                                 record["sha256"]))
    return entries


def _cache_layout(memory: StreamingMemory) -> tuple[int, int, int, torch.dtype]:
    """(full-attention layers, KV heads, head dim, dtype) of the memory's KV cache."""
    keys = [t for name, t in memory.export_state().tensors.items() if name.endswith(".keys")]
    return len(keys), keys[0].shape[1], keys[0].shape[3], keys[0].dtype


def _problem(piece: TierPiece, record: dict, layout: tuple) -> str | None:
    """Why `piece` cannot be the recorded chunk of this model's cache, or None."""
    layers, heads, dim, dtype = layout
    n = record["tokens"]
    if piece.chunk != record["chunk"]:
        return f"holds chunk {piece.chunk}, recorded as chunk {record['chunk']}"
    for name, shape, kind in (("keys", (layers, heads, n, dim), dtype),
                              ("values", (layers, heads, n, dim), dtype),
                              ("position", (3, n), torch.int64), ("score", (n,), torch.float32)):
        tensor = getattr(piece, name)
        if tuple(tensor.shape) != shape or tensor.dtype != kind:
            return (f"{name} is {tensor.dtype} {list(tensor.shape)}; this memory needs "
                    f"{kind} {list(shape)}")
    if not (piece.keys.isfinite().all() and piece.values.isfinite().all()):
        return "its keys or values are not finite"
    return None


def _plain_name(name: Any) -> bool:
    """A file or folder name with no path in it (a memory file names nothing outside its own
    folder)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
