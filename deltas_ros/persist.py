"""Saving a streaming memory to disk and continuing the stream from it after a restart.

    save_memory(memory, "~/.ros/deltas/memory.safetensors", extra={"bag": "run3"})
    memory = StreamingMemory(load_model(path), config)      # same model, same configuration
    load_memory(memory, "~/.ros/deltas/memory.safetensors")  # returns the metadata

The file is ONE safetensors file: the tensors of `MemoryState` (recurrent and conv states of every
linear-attention layer, keys and values of every full-attention layer, slot times, scores, chunks
and 3-D positions), and in the header's `__metadata__` (str -> str) one key, "deltas_ros.memory",
holding JSON:

    format, format_version   "deltas_ros.memory", 1
    created, created_unix    UTC ISO time and seconds since the epoch
    model                    {"name": model directory name, "config_sha256": see config_sha256}
    dtype                    the model's dtype (the KV cache's)
    config                   the MemoryConfig fields that shape the stored state (CHECKED_CONFIG)
    stream                   next_position, chunks_seen, compactions, kv_tokens, last_stamp,
                             chunk_stamps {chunk index: header stamp or null}
    extra                    the caller's JSON-serialisable dict
    sha256                   over the canonical JSON of everything above and every tensor's name,
                             dtype, shape and bytes in name order

Loading reads only safetensors and JSON: no pickle, nothing is executed. It refuses, with a
MemoryFileError naming the reason, a file from another model or format version, with another
memory configuration, truncated or tampered with, and then leaves the memory untouched: everything
is checked before anything is assigned. Saving writes a temporary file beside the target, fsyncs it
and renames it over the target, so a crash leaves the old file or the new one; mode 0600.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .memory import MemoryState, StreamingMemory

FORMAT = "deltas_ros.memory"
FORMAT_VERSION = 1
METADATA_KEY = "deltas_ros.memory"
# MemoryConfig fields a stored stream depends on; the others (answer length, ...) may change.
CHECKED_CONFIG = ("budget_tokens", "sink_tokens", "window_tokens", "buckets", "policy", "seed",
                  "pixel_budget")
# Metadata fields loading reads, and their JSON types.
_FIELDS = {"model": dict, "dtype": str, "config": dict, "stream": dict, "extra": dict,
           "sha256": str}
_STREAM_FIELDS = {"next_position": int, "chunks_seen": int, "compactions": int,
                  "chunk_stamps": dict}
# Config entries that do not change what the model computes from a cached state.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}


class MemoryFileError(ValueError):
    """A memory file that cannot continue this memory's stream; the memory was left untouched."""


def save_memory(memory: StreamingMemory, path: str | Path, extra: dict | None = None) -> Path:
    """Write the memory's whole state to `path` atomically (mode 0600); returns the path."""
    path = Path(path).expanduser()
    state = memory.export_state()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.tensors.items()}
    stamps = state.chunk_stamps
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_unix": (now := time.time()),
        "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "model": _model_identity(memory),
        "dtype": _dtype_name(memory.loaded.dtype),
        "config": {name: getattr(memory.config, name) for name in CHECKED_CONFIG},
        "stream": {
            "next_position": state.next_position,
            "chunks_seen": state.chunks_seen,
            "compactions": state.compactions,
            "kv_tokens": memory.kv_tokens,
            "last_stamp": stamps.get(state.chunks_seen - 1),
            "chunk_stamps": {str(c): s for c, s in sorted(stamps.items())},
        },
        "extra": dict(extra or {}),
    }
    metadata["sha256"] = _checksum(metadata, tensors)  # raises for non-JSON extra: nothing written
    header = {METADATA_KEY: json.dumps(metadata)}

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(temporary, 0o600)
        save_file(tensors, temporary, metadata=header)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def load_memory(memory: StreamingMemory, path: str | Path) -> dict:
    """Replace the memory's state with the one saved at `path`; returns the file's metadata.

    Raises MemoryFileError (the memory untouched) unless the file continues this memory's stream.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no memory file at {path}")
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            metadata = _parse_metadata(file.metadata(), path)
            _check_compatible(metadata, memory, path)
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except SafetensorError as error:
        raise MemoryFileError(f"{path} is truncated or not a safetensors file: {error}") from error
    claimed = metadata.pop("sha256")
    if claimed != _checksum(metadata, tensors):
        raise MemoryFileError(f"{path} fails its sha256 checksum: the file was altered or damaged")
    metadata["sha256"] = claimed
    stream = metadata["stream"]
    state = MemoryState(
        tensors=tensors,
        next_position=stream["next_position"],
        chunks_seen=stream["chunks_seen"],
        compactions=stream["compactions"],
        chunk_stamps={int(c): s for c, s in stream["chunk_stamps"].items()},
    )
    try:
        memory.import_state(state)
    except ValueError as error:
        raise MemoryFileError(f"{path}: {error}") from error
    return metadata


def config_sha256(config) -> str:
    """sha256 of a model config's JSON with sorted keys, without the entries that do not change
    what the model computes (transformers version, dtype, where it was loaded from)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
        return value

    raw = json.loads(config.to_json_string(use_diff=False))
    return hashlib.sha256(json.dumps(strip(raw), sort_keys=True).encode()).hexdigest()


def _model_identity(memory: StreamingMemory) -> dict[str, str]:
    return {"name": memory.loaded.path.name, "config_sha256": config_sha256(memory.model.config)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_metadata(header: dict[str, str] | None, path: Path) -> dict:
    """The file's JSON metadata, checked for the fields and types loading relies on."""
    try:
        metadata = json.loads((header or {})[METADATA_KEY])
    except (KeyError, ValueError) as error:
        raise MemoryFileError(f"{path} is not a deltas_ros memory file ({error!r})") from error
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise MemoryFileError(f"{path} is not a deltas_ros memory file")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise MemoryFileError(f"{path} has format version {metadata.get('format_version')}; "
                              f"this deltas_ros reads version {FORMAT_VERSION}")
    stream = metadata.get("stream")
    fields = [(metadata, key, kind) for key, kind in _FIELDS.items()]
    if isinstance(stream, dict):
        fields += [(stream, key, kind) for key, kind in _STREAM_FIELDS.items()]
    malformed = [key for where, key, kind in fields if not isinstance(where.get(key), kind)]
    if isinstance(stream, dict) and isinstance(stream.get("chunk_stamps"), dict):
        malformed += [f"chunk_stamps[{c!r}]" for c, s in stream["chunk_stamps"].items()
                      if not c.isdigit() or not isinstance(s, (int, float, type(None)))]
    if malformed:
        raise MemoryFileError(f"{path} has malformed metadata: {', '.join(malformed)}")
    return metadata


def _check_compatible(metadata: dict, memory: StreamingMemory, path: Path) -> None:
    """Same model, dtype and memory configuration as `memory`, or a MemoryFileError saying which
    differ."""
    saved, ours = metadata["model"], _model_identity(memory)
    if saved != ours:
        raise MemoryFileError(
            f"{path} was saved from another model: {saved.get('name')!r} (config sha256 "
            f"{str(saved.get('config_sha256'))[:12]}), this memory runs {ours['name']!r} "
            f"({ours['config_sha256'][:12]})")
    if metadata["dtype"] != _dtype_name(memory.loaded.dtype):
        raise MemoryFileError(f"{path} holds a {metadata['dtype']} cache, this model runs "
                              f"{_dtype_name(memory.loaded.dtype)}")
    differ = [f"{name} {metadata['config'].get(name)!r} (this memory: "
              f"{getattr(memory.config, name)!r})"
              for name in CHECKED_CONFIG
              if metadata["config"].get(name) != getattr(memory.config, name)]
    if differ:
        raise MemoryFileError(f"{path} was saved with another memory configuration: "
                              + ", ".join(differ))


def _checksum(metadata: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over canonical JSON metadata and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"\n{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
