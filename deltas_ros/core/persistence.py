"""Saving a streaming memory to disk and continuing the stream from it after a restart.

    save_memory(memory, "~/.ros/deltas/memory.safetensors", extra={"bag": "run3"})
    memory = StreamingMemory(load_model(path), config)      # same model, same configuration
    load_memory(memory, "~/.ros/deltas/memory.safetensors")  # returns the metadata

The file is ONE safetensors file: the tensors of `MemoryState` (recurrent and conv states of every
linear-attention layer, keys and values of every full-attention layer, slot times, scores, chunks
and 3-D positions), and in the header's `__metadata__` (str -> str) one key, "deltas_ros.memory",
holding JSON:

    format, format_version   "deltas_ros.memory", 4 (versions 2 and 3, without poses or tiers,
                             load too)
    created, created_unix    UTC ISO time and seconds since the epoch
    model                    {"name": model directory name (informative only),
                              "config_sha256": see model.config_sha256,
                              "weights_sha256": see weights_sha256}: the model's identity is its
                             content, so a copy of the model under another name loads the file
    dtype                    the model's dtype (the KV cache's)
    config                   the MemoryConfig fields that shape the stored state (CHECKED_CONFIG)
    stream                   next_position, chunks_seen, compactions, kv_tokens, last_stamp,
                             chunk_stamps {chunk index: header stamp or null},
                             chunk_poses {chunk index: [frame_id, x, y, z, qx, qy, qz, qw] or
                             null} (version 3: the robot pose at the chunk's stamp)
    tiers                    (a memory with a second tier) {"folder": the folder beside the
                             file holding the tiered chunks, "chunks": [{chunk, file, sha256,
                             tokens, time_s, shift}]}: see tier_saving.py; the files are
                             checked against their sha256 on load
    extra                    the caller's JSON-serialisable dict
    sha256                   over the canonical JSON of everything above and every tensor's name,
                             dtype, shape and bytes in name order
    hmac                     (only when saved with a key) HMAC-SHA256 with that key over the same
                             bytes as sha256

Loading reads only safetensors and JSON: no pickle, nothing is executed. It refuses, with a
MemoryFileError naming the reason, a file from another model or format version, with another
memory configuration, truncated or tampered with, or with a tier file that is missing, altered or
not this model's, and then leaves the memory untouched: everything is checked before anything is
assigned. In order: the safetensors header alone (at most
MAX_HEADER_BYTES; every declared tensor's name, dtype and shape must be the memory's own with at
most budget_tokens slots, and its bytes inside the file, so a file declaring a huge tensor is
refused before any tensor data is read); every metadata field's type and range; the checksum (and
the HMAC when a key is given: the sha256 only catches damage, since anyone who can write the file
can recompute it, while the HMAC cannot be forged without the key); then the state itself (finite
states, consistent slots and counters, `state_check`). Saving writes a temporary file beside
the target, fsyncs it and renames it over the target, so a crash leaves the old file or the new
one; mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import shutil
import struct
import tempfile
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .loader import config_sha256
from .memory import MemoryState, StreamingMemory
from .poses import Pose
from .slot_table import MAX_CHUNKS
from .state_check import check_tensor_names, expected_tensors
from .tier_saving import check_tiers, malformed_tiers, remove_tier_folders, save_tiers
from .tiers import TierStore

FORMAT = "deltas_ros.memory"
# 2: slots.arrival (slots may sit out of arrival order); 3: chunk_poses; 4: tiers
FORMAT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)  # a version 2 file is a stream without poses, 3 without tiers
METADATA_KEY = "deltas_ros.memory"
MAX_HEADER_BYTES = 16 << 20  # a memory file's header is a few KB of JSON plus the stamps
# MemoryConfig fields a stored stream depends on; the others (answer length, ...) may change.
CHECKED_CONFIG = ("budget_tokens", "sink_tokens", "window_tokens", "buckets", "policy", "seed",
                  "pixel_budget")
# Metadata fields loading reads, and their JSON types.
_FIELDS = {"created": str, "created_unix": (int, float), "model": dict, "dtype": str,
           "config": dict, "stream": dict, "extra": dict, "sha256": str}
_MODEL_FIELDS = {"name": str, "config_sha256": str}
_COUNTERS = ("next_position", "chunks_seen", "compactions", "kv_tokens")
# safetensors' dtype codes of the dtypes a memory file holds.
_DTYPE_CODES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
                torch.bfloat16: "BF16", torch.float16: "F16"}
_WEIGHTS_SAMPLE = 1024  # elements per weight tensor in the weights fingerprint
_weights_sha256: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MemoryFileError(ValueError):
    """A memory file that cannot continue this memory's stream; the memory was left untouched."""


def save_memory(memory: StreamingMemory, path: str | Path, extra: dict | None = None,
                key: bytes | None = None) -> Path:
    """Write the memory's whole state to `path` atomically (mode 0600); returns the path.

    key: sign the file with HMAC-SHA256 under this key; `load_memory(..., key=key)` then refuses
    any file not signed with it.
    """
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
            "chunk_poses": {str(c): _stored_pose(p)
                            for c, p in sorted(state.chunk_poses.items())},
        },
        "extra": dict(extra or {}),
    }
    # Raises for non-JSON extra: nothing written.
    json.dumps(metadata, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    if (tiers := save_tiers(memory, path)) is not None:
        metadata["tiers"] = tiers
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        metadata["sha256"], signature = digests(metadata, tensors, key)
        if signature is not None:
            metadata["hmac"] = signature
        header = {METADATA_KEY: json.dumps(metadata, allow_nan=False)}
        os.chmod(temporary, 0o600)
        save_file(tensors, temporary, metadata=header)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        if tiers is not None:
            shutil.rmtree(path.parent / tiers["folder"], ignore_errors=True)
        raise
    _fsync_directory(path.parent)
    remove_tier_folders(path, keep=None if tiers is None else tiers["folder"])
    return path


def load_memory(memory: StreamingMemory, path: str | Path, key: bytes | None = None) -> dict:
    """Replace the memory's state with the one saved at `path`; returns the file's metadata.

    key: the file must carry an HMAC-SHA256 under this key (see save_memory).
    Raises MemoryFileError (the memory untouched) unless the file continues this memory's stream.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no memory file at {path}")
    header = _read_header(path)
    metadata = _parse_metadata(header.pop("__metadata__", None), path)
    _check_compatible(metadata, memory, path)
    shapes = _check_declared(header, metadata, memory, path)
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            # The file may have been replaced since its header was read: sizes again, unread.
            if {name: file.get_slice(name).get_shape() for name in file.keys()} != shapes:
                raise MemoryFileError(f"{path} changed while it was being loaded")
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except SafetensorError as error:
        raise MemoryFileError(f"{path} is truncated or not a safetensors file: {error}") from error
    claimed, signature = metadata.pop("sha256"), metadata.pop("hmac", None)
    checksum, expected_signature = digests(metadata, tensors, key)
    if claimed != checksum:
        raise MemoryFileError(f"{path} fails its sha256 checksum: the file was altered or damaged")
    if key is not None and signature is None:
        raise MemoryFileError(f"{path} is not signed, and a key is required")
    if key is not None and not hmac.compare_digest(str(signature), expected_signature):
        raise MemoryFileError(f"{path} fails its HMAC: written without this key, or altered")
    metadata["sha256"] = claimed
    if signature is not None:
        metadata["hmac"] = signature
    stream = metadata["stream"]
    state = MemoryState(
        tensors=tensors,
        next_position=stream["next_position"],
        chunks_seen=stream["chunks_seen"],
        compactions=stream["compactions"],
        chunk_stamps={int(c): None if s is None else float(s)
                      for c, s in stream["chunk_stamps"].items()},
        chunk_poses={int(c): None if p is None else Pose.from_json(p)
                     for c, p in stream.get("chunk_poses", {}).items()},
    )
    try:
        tiered = check_tiers(memory, metadata.get("tiers"), path)
    except ValueError as error:
        raise MemoryFileError(f"{path}: {error}") from error
    tiered = memory.tiers.linked(tiered) if memory.tiers is not None else []
    try:
        memory.import_state(state)
    except ValueError as error:
        TierStore.unlink(tiered)
        raise MemoryFileError(f"{path}: {error}") from error
    if memory.tiers is not None:
        memory.tiers.adopt(tiered)
    return metadata


def weights_sha256(model: torch.nn.Module) -> str:
    """A fingerprint of a model's weights: sha256 over every tensor's name, shape and up to
    1024 evenly strided values rounded to bf16 (so float32 and bf16 loads of the same weights
    agree; the cache dtype is checked on its own). Computed once per model object: cheap even
    at 9B, and a copy of the same model under another directory gets the same one."""
    if model in _weights_sha256:
        return _weights_sha256[model]
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _WEIGHTS_SAMPLE)][:_WEIGHTS_SAMPLE]
            digest.update(f"{name} {tuple(tensor.shape)}\n".encode())
            digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    _weights_sha256[model] = digest.hexdigest()
    return _weights_sha256[model]


def _model_identity(memory: StreamingMemory) -> dict[str, str]:
    return {"name": memory.loaded.path.name, "config_sha256": config_sha256(memory.model.config),
            "weights_sha256": weights_sha256(memory.model)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read_header(path: Path) -> dict:
    """The safetensors header (JSON) alone: no tensor data is read."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise MemoryFileError(f"{path} is truncated or not a safetensors file (header of "
                                  f"{length} bytes in a file of {size})")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise MemoryFileError(f"{path} is not a safetensors file: {error}") from error
    if not isinstance(header, dict):
        raise MemoryFileError(f"{path} is not a safetensors file")
    header["__data_bytes__"] = size - 8 - length
    return header


def _check_declared(header: dict, metadata: dict, memory: StreamingMemory,
                    path: Path) -> dict[str, list[int]]:
    """Every tensor the header declares is one this memory has, of its dtype and shape, with at
    most budget_tokens slots and its bytes inside the file; checked before any data is read.
    Returns the checked shapes by name."""
    data_bytes = header.pop("__data_bytes__")
    declared = header.get("slots.time", {}).get("shape") if isinstance(
        header.get("slots.time"), dict) else None
    slots = declared[0] if isinstance(declared, list) and len(declared) == 1 else None
    if type(slots) is not int or not 0 < slots <= memory.config.budget_tokens:
        raise MemoryFileError(f"{path} declares {slots!r} cache slots; this memory holds 1 to "
                              f"{memory.config.budget_tokens}")
    if metadata["stream"]["kv_tokens"] != slots:
        raise MemoryFileError(f"{path}: kv_tokens {metadata['stream']['kv_tokens']} but "
                              f"{slots} slots stored")
    expected = expected_tensors(memory.export_state().tensors, slots)
    try:
        check_tensor_names(header.keys(), expected)
    except ValueError as error:
        raise MemoryFileError(f"{path}: {error}") from error
    for name, (dtype, shape) in expected.items():
        entry = header[name]
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        size = math.prod(shape) * dtype.itemsize
        if (not isinstance(entry, dict) or entry.get("dtype") != _DTYPE_CODES.get(dtype)
                or entry.get("shape") != list(shape) or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or offsets[1] - offsets[0] != size):
            described = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else ()
            raise MemoryFileError(f"{path}: {name} is declared as {' '.join(map(str, described))}"
                                  f"; this memory needs {_DTYPE_CODES.get(dtype)} {list(shape)}")
        if not 0 <= offsets[0] <= data_bytes - size:
            raise MemoryFileError(f"{path} is truncated or damaged: {name}'s bytes lie outside "
                                  f"the file")
    return {name: list(shape) for name, (_, shape) in expected.items()}


def _parse_metadata(text: Any, path: Path) -> dict:
    """The file's JSON metadata, every field checked for its type and range."""
    try:
        metadata = json.loads(text[METADATA_KEY]) if isinstance(text, dict) else None
    except (KeyError, TypeError, ValueError) as error:
        raise MemoryFileError(f"{path} is not a deltas_ros memory file ({error!r})") from error
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise MemoryFileError(f"{path} is not a deltas_ros memory file")
    version = metadata.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise MemoryFileError(f"{path} has format version {version}; this deltas_ros reads "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    malformed = [key for key, kind in _FIELDS.items() if not _is(metadata.get(key), kind)]
    if "hmac" in metadata and not isinstance(metadata["hmac"], str):
        malformed.append("hmac")
    model, stream = metadata.get("model"), metadata.get("stream")
    if isinstance(model, dict):
        malformed += [f"model.{key}" for key, kind in _MODEL_FIELDS.items()
                      if not isinstance(model.get(key), kind)]
    if isinstance(stream, dict):
        malformed += [f"stream.{key}" for key in _COUNTERS if not _counter(stream.get(key))]
        if "last_stamp" not in stream or not _stamp(stream["last_stamp"]):
            malformed.append("stream.last_stamp")
        stamps = stream.get("chunk_stamps")
        if not isinstance(stamps, dict):
            malformed.append("stream.chunk_stamps")
        else:
            malformed += [f"chunk_stamps[{c!r}]" for c, s in stamps.items()
                          if not (c.isdigit() and int(c) < MAX_CHUNKS and _stamp(s))]
        poses = stream.get("chunk_poses", {} if version == 2 else None)
        if not isinstance(poses, dict):
            malformed.append("stream.chunk_poses")
        else:
            malformed += [f"chunk_poses[{c!r}]" for c, p in poses.items()
                          if not (c.isdigit() and int(c) < MAX_CHUNKS and _pose(p))]
        if "tiers" in metadata and _counter(stream.get("chunks_seen")):
            malformed += malformed_tiers(metadata["tiers"], stream["chunks_seen"])
    if malformed:
        raise MemoryFileError(f"{path} has malformed metadata: {', '.join(malformed)}")
    return metadata


def _is(value: Any, kind) -> bool:
    """isinstance, with bools not counting as numbers and numbers finite."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, kind) and (not isinstance(value, float) or math.isfinite(value))


def _counter(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_CHUNKS


def _stamp(value: Any) -> bool:
    """A header stamp: None or a finite number (not a string, not a bool)."""
    return value is None or _is(value, (int, float))


def _stored_pose(pose: Pose | None) -> list | None:
    """What a file stores for a chunk's pose: Pose.to_json, or None (unknown) for a pose that
    is not storable, so one chunk's metadata never fails a whole save."""
    try:
        return None if pose is None else Pose.from_json(pose.to_json()).to_json()
    except ValueError:
        return None


def _pose(value: Any) -> bool:
    """A stored pose: None or what Pose.to_json writes (finite, non-zero quaternion)."""
    if value is None:
        return True
    try:
        Pose.from_json(value)
    except (TypeError, ValueError):
        return False
    return True


def _check_compatible(metadata: dict, memory: StreamingMemory, path: Path) -> None:
    """Same model (by content: config and weights), dtype and memory configuration as `memory`,
    or a MemoryFileError saying which differ."""
    saved, ours = metadata["model"], _model_identity(memory)
    same = saved["config_sha256"] == ours["config_sha256"] and saved.get(
        "weights_sha256", ours["weights_sha256"]) == ours["weights_sha256"]
    if not same:
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


def digests(metadata: dict, tensors: dict[str, torch.Tensor],
             key: bytes | None) -> tuple[str, str | None]:
    """(sha256, HMAC-SHA256 under key or None) over canonical JSON metadata and every tensor's
    name, dtype, shape and bytes."""
    hashes = [hashlib.sha256()] + ([hmac.new(key, digestmod=hashlib.sha256)] if key else [])

    def update(data) -> None:
        for h in hashes:
            h.update(data)

    update(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        update(f"\n{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return hashes[0].hexdigest(), hashes[1].hexdigest() if key else None


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
