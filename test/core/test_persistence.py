"""Saving and loading a memory: bit-identical continuation, the file format, refusals."""

import json
import math
import pickle
import shutil
import stat

import pytest
from engine_helpers import TINY_FRAMES, assert_same_state, feed, frames_for, frozen
from safetensors import safe_open
from safetensors.torch import save_file

from deltas_ros.core import persistence as persist
from deltas_ros.core.loader import load_model
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.model_maker import make_model, tiny_config
from deltas_ros.core.persistence import (
    MemoryFileError,
    config_sha256,
    load_memory,
    save_memory,
    weights_sha256,
)
from deltas_ros.core.poses import Pose

PERSIST_CONFIG = dict(budget_tokens=160, window_tokens=40, max_new_tokens=3, compact_margin=64,
                      **TINY_FRAMES)


def test_loaded_memory_continues_bit_identically(tiny_model, tmp_path):
    original = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    original.max_positions = 300  # compactions before and after the restart
    feed(original, range(14))
    original.ask("What is on the table?")
    path = save_memory(original, tmp_path / "memory.safetensors")
    assert original.compactions >= 1

    restored = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    restored.max_positions = 300
    load_memory(restored, path)
    assert_same_state(frozen(restored), frozen(original))

    later = range(14, 26)
    continued, never_stopped = feed(restored, later), feed(original, later)
    assert [r.drift for r in continued] == [r.drift for r in never_stopped]
    assert [r.layer_drift for r in continued] == [r.layer_drift for r in never_stopped]
    assert sum(r.positions_freed for r in continued) > 0
    assert_same_state(frozen(restored), frozen(original))
    assert restored.ask("And now?").text == original.ask("And now?").text


def test_memory_file_is_one_private_safetensors_file(tiny_model, tmp_path):
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    feed(memory, range(3))
    path = save_memory(memory, tmp_path / "sub" / "memory.safetensors", extra={"bag": "run3"})

    assert [p.name for p in path.parent.iterdir()] == ["memory.safetensors"]  # no temp files
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with safe_open(path, framework="pt") as file:
        metadata = json.loads(file.metadata()[persist.METADATA_KEY])
        assert set(file.keys()) == set(memory.export_state().tensors)
    assert metadata["format_version"] == persist.FORMAT_VERSION
    assert metadata["model"] == {"name": "tiny",
                                 "config_sha256": config_sha256(tiny_model.model.config),
                                 "weights_sha256": weights_sha256(tiny_model.model)}
    assert metadata["config"]["budget_tokens"] == 160
    assert metadata["config"]["policy"] == "surprise"
    assert metadata["stream"]["chunks_seen"] == 3 and metadata["stream"]["last_stamp"] == 1002.0
    assert metadata["extra"] == {"bag": "run3"} and len(metadata["sha256"]) == 64
    assert load_memory(memory, path) == metadata


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A memory file of 4 chunks saved with PERSIST_CONFIG."""
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    feed(memory, range(4))
    return save_memory(memory, tmp_path_factory.mktemp("saved") / "memory.safetensors")


def rewrite(source, target, change, keep_checksum=True):
    """Copy a memory file with `change(metadata, tensors)` applied; re-sign it unless told not."""
    with safe_open(source, framework="pt") as file:
        metadata = json.loads(file.metadata()[persist.METADATA_KEY])
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    change(metadata, tensors)
    if not keep_checksum:  # as anyone who can write the file can; an HMAC stays as it was
        metadata.pop("sha256")
        signature = metadata.pop("hmac", None)
        metadata["sha256"] = persist.digests(metadata, tensors, None)[0]
        if signature is not None:
            metadata["hmac"] = signature
    save_file(tensors, target, metadata={persist.METADATA_KEY: json.dumps(metadata)})
    return target


def truncated(source, target):
    target.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return target


def flipped_byte(source, target):
    data = bytearray(source.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's bytes
    target.write_bytes(bytes(data))
    return target


def other_version(source, target):
    return rewrite(source, target, lambda m, t: m.update(format_version=1))


def moved_position(source, target):
    return rewrite(source, target, lambda m, t: m["stream"].update(next_position=9))


def missing_tensor(source, target):
    return rewrite(source, target, lambda m, t: t.pop("slots.score"), keep_checksum=False)


def not_a_memory_file(source, target):
    target.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14)
    return target


@pytest.mark.parametrize("make_bad, config, match", [
    (truncated, {}, "truncated"),
    (flipped_byte, {}, "checksum"),
    (moved_position, {}, "checksum"),
    (other_version, {}, "format version 1; this deltas_ros reads versions 2, 3"),
    (missing_tensor, {}, "missing \\['slots.score'\\]"),
    (not_a_memory_file, {}, "not a deltas_ros memory file"),
    (None, {"budget_tokens": 200}, "budget_tokens 160 \\(this memory: 200\\)"),
    (None, {"policy": "recency", "window_tokens": 50}, "window_tokens 40.*policy 'surprise'"),
], ids=["truncated", "flipped-byte", "edited-metadata", "format-version", "missing-tensor",
        "not-a-memory-file", "budget", "policy"])
def test_bad_files_are_refused_and_change_nothing(tiny_model, saved, tmp_path, make_bad, config,
                                                  match):
    memory = StreamingMemory(tiny_model, MemoryConfig(**(PERSIST_CONFIG | config)))
    feed(memory, range(10, 12))
    before = frozen(memory)
    path = make_bad(saved, tmp_path / "bad.safetensors") if make_bad else saved
    with pytest.raises(MemoryFileError, match=match):
        load_memory(memory, path)
    assert_same_state(frozen(memory), before)


def test_a_pickle_is_refused_without_running_it(tiny_model, tmp_path):
    flag = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(flag)!r}, 'w').write('ran')",)

    path = tmp_path / "memory.safetensors"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(MemoryFileError):
        load_memory(StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG)), path)
    assert not flag.exists()


def test_a_file_from_another_model_is_refused(tiny_model, tmp_path):
    config = tiny_config()
    config.text_config.intermediate_size = 96
    other = StreamingMemory(load_model(make_model(tmp_path / "other", config), device="cpu"),
                            MemoryConfig(**PERSIST_CONFIG))
    path = save_memory(other, tmp_path / "memory.safetensors")
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    before = frozen(memory)
    with pytest.raises(MemoryFileError, match="another model: 'other'.*this memory runs 'tiny'"):
        load_memory(memory, path)
    assert_same_state(frozen(memory), before)


def test_a_failed_save_keeps_the_previous_file(tiny_model, tmp_path, monkeypatch):
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    previous = path.read_bytes()
    feed(memory, range(2))

    def disk_full(tensors, filename, metadata):
        open(filename, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_memory(memory, path)
    assert path.read_bytes() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["memory.safetensors"]


# ------------------------------------------------------------------ doctored files
def resigned(change):
    """A doctoring that re-signs the checksum, as anyone who can write the file can."""
    return lambda source, target: rewrite(source, target, change, keep_checksum=False)


def missing_field(m, t):
    del m["stream"]["kv_tokens"]


def string_stamps(m, t):
    m["stream"]["chunk_stamps"] = {c: str(s) for c, s in m["stream"]["chunk_stamps"].items()}


def huge_chunks_seen(m, t):
    m["stream"]["chunks_seen"] = 2**40


def nan_states(m, t):
    t["layers.0.recurrent_state"][..., 0] = float("nan")


def nan_stamp(m, t):
    m["stream"]["last_stamp"] = float("nan")  # json writes NaN, json.loads reads it back


def bad_pose(m, t):
    m["stream"]["chunk_poses"]["1"] = ["map", 0, 0, 0, 0, 0, 0, 0]  # zero quaternion


def no_poses(m, t):
    del m["stream"]["chunk_poses"]  # required from version 3


def bool_counter(m, t):
    m["stream"]["compactions"] = True


def huge_declared_tensor(source, target):
    """A file whose header declares a 2.5 GB key tensor: the header must refuse it unread."""
    with open(source, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
        data = file.read()
    entry = header["layers.3.keys"]
    entry["shape"] = [1, 2, 10_000_000, 32]
    entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][0] + 2_560_000_000]
    raw = json.dumps(header).encode()
    target.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return target


@pytest.mark.parametrize("make_bad, match", [
    (resigned(missing_field), "malformed metadata: stream.kv_tokens"),
    (resigned(string_stamps), "malformed metadata: chunk_stamps"),
    (resigned(huge_chunks_seen), "malformed metadata: stream.chunks_seen"),
    (resigned(bool_counter), "malformed metadata: stream.compactions"),
    (resigned(nan_stamp), "malformed metadata: stream.last_stamp"),
    (resigned(nan_states), "layers.0.recurrent_state holds NaN"),
    (resigned(bad_pose), "malformed metadata: chunk_poses\\['1'\\]"),
    (resigned(no_poses), "malformed metadata: stream.chunk_poses"),
    (huge_declared_tensor, "layers.3.keys is declared as F32 \\[1, 2, 10000000, 32\\]"),
], ids=["missing-key", "string-stamps", "chunks-seen-2^40", "bool-counter", "nan-stamp",
        "nan-states", "bad-pose", "no-poses", "huge-declared-tensor"])
def test_doctored_files_are_refused_and_change_nothing(tiny_model, saved, tmp_path, make_bad,
                                                       match, monkeypatch):
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    feed(memory, range(10, 12))
    before = frozen(memory)
    path = make_bad(saved, tmp_path / "bad.safetensors")
    reads = []
    monkeypatch.setattr(persist, "safe_open",
                        lambda *a, **k: reads.append(a) or safe_open(*a, **k))
    with pytest.raises(MemoryFileError, match=match):
        load_memory(memory, path)
    assert_same_state(frozen(memory), before)
    if make_bad is huge_declared_tensor:
        assert reads == []  # refused from the header alone: no tensor data was read
    feed(memory, range(12, 13))  # and the memory goes on


def test_a_signed_file_needs_its_key(tiny_model, tmp_path):
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    feed(memory, range(3))
    key = b"k" * 32
    signed = save_memory(memory, tmp_path / "signed.safetensors", key=key)
    unsigned = save_memory(memory, tmp_path / "unsigned.safetensors")
    forged = rewrite(signed, tmp_path / "forged.safetensors",
                     lambda m, t: m["extra"].update(by="someone"), keep_checksum=False)
    other = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    before = frozen(other)
    for path, wrong_key, match in [(signed, b"x" * 32, "fails its HMAC"),
                                   (forged, key, "fails its HMAC"),
                                   (unsigned, key, "not signed")]:
        with pytest.raises(MemoryFileError, match=match):
            load_memory(other, path, key=wrong_key)
        assert_same_state(frozen(other), before)
    assert load_memory(other, signed, key=key)["hmac"]
    assert_same_state(frozen(other), frozen(memory))


def test_a_copy_of_the_model_under_another_name_loads_its_memory(tiny_model, tiny_model_dir,
                                                                  tmp_path):
    copy_dir = tmp_path / "renamed-copy"
    shutil.copytree(tiny_model_dir, copy_dir)
    copied = StreamingMemory(load_model(copy_dir, device="cpu"), MemoryConfig(**PERSIST_CONFIG))
    feed(copied, range(3))
    path = save_memory(copied, tmp_path / "memory.safetensors")
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    assert load_memory(memory, path)["model"]["name"] == "renamed-copy"
    assert_same_state(frozen(memory), frozen(copied))


def test_same_config_other_weights_is_another_model(tiny_model, tmp_path):
    other = StreamingMemory(load_model(make_model(tmp_path / "tiny", seed=1), device="cpu"),
                            MemoryConfig(**PERSIST_CONFIG))
    path = save_memory(other, tmp_path / "memory.safetensors")
    with pytest.raises(MemoryFileError, match="another model"):
        load_memory(StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG)), path)


def test_chunk_poses_are_saved_and_a_version_2_file_still_loads(tiny_model, tmp_path):
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    for c in range(6):  # chunk 2 has no pose; the budget evicts some
        pose = None if c == 2 else Pose.checked("map", (c, -c, 0.5), (0, 0, c, 1))
        memory.add_chunk(frames_for(c), [c, c + 0.5], stamp=1000.0 + c, pose=pose)
    path = save_memory(memory, tmp_path / "memory.safetensors")
    restored = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    load_memory(restored, path)
    assert restored.slots.poses == memory.slots.poses and None in memory.slots.poses.values()
    assert_same_state(frozen(restored), frozen(memory))

    def version_2(m, t):
        m["format_version"] = 2
        del m["stream"]["chunk_poses"]

    old = rewrite(path, tmp_path / "v2.safetensors", version_2, keep_checksum=False)
    assert load_memory(restored, old)["format_version"] == 2
    assert restored.slots.poses == {}
    assert restored.slots.stamps == memory.slots.stamps


def test_a_pose_that_cannot_be_stored_is_saved_as_unknown(tiny_model, tmp_path):
    """One chunk's metadata never fails a whole save: the file keeps the pose as unknown."""
    memory = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    memory.add_chunk(frames_for(0), [0, 0.5], stamp=1000.0,
                     pose=Pose("odom", (-math.inf, 0.0, 0.0)))
    memory.add_chunk(frames_for(1), [1, 1.5], stamp=1001.0,
                     pose=Pose.checked("odom", (1, 2, 3), (0, 0, 0, 1)))
    path = save_memory(memory, tmp_path / "memory.safetensors")
    restored = StreamingMemory(tiny_model, MemoryConfig(**PERSIST_CONFIG))
    load_memory(restored, path)
    assert restored.slots.poses == {0: None, 1: memory.slots.poses[1]}
