"""Memory files only inside memory_dir; existing files replaced only when they are memory files;
a key file only when nobody else can read it. No ROS, no model."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from deltas_ros.runtime.files import (
    METADATA_KEY,
    RESET_FILES,
    MemoryFiles,
    MemoryPathError,
    default_memory_dir,
    is_memory_file,
    read_key,
    read_metadata,
)


def fake_memory_file(path: Path, metadata: dict | None = None) -> Path:
    """A safetensors header with deltas_ros metadata and no tensors."""
    header = {"__metadata__": {METADATA_KEY: json.dumps(metadata or {"format": "x"})}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


@pytest.fixture
def files(tmp_path) -> MemoryFiles:
    return MemoryFiles(tmp_path / "memory")


def test_the_directory_is_created_private_and_names_resolve_inside_it(files, tmp_path):
    assert files.root == (tmp_path / "memory").resolve()
    assert oct(files.root.stat().st_mode & 0o777) == "0o700"
    assert files.resolve("") == files.root / "memory.safetensors"
    assert files.resolve("run3.safetensors") == files.root / "run3.safetensors"
    assert files.resolve(str(files.root / "a.safetensors")) == files.root / "a.safetensors"
    (files.root / "runs").mkdir()
    assert files.resolve("runs/b.safetensors") == files.root / "runs" / "b.safetensors"


@pytest.mark.parametrize("requested,reason", [
    ("../escape.safetensors", "'..'"),
    ("runs/../../escape", "'..'"),
    ("/tmp/elsewhere.safetensors", "outside memory_dir"),
    ("/etc/passwd", "outside memory_dir"),
    ("missing/folder/x.safetensors", "does not exist"),
    ("a\x00b", "NUL"),
    (".", "outside memory_dir"),
])
def test_paths_leading_out_or_into_missing_folders_are_refused(files, tmp_path, requested,
                                                               reason):
    with pytest.raises(MemoryPathError, match=reason):
        files.resolve(requested)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory"]  # nothing created
    assert not (files.root / "missing").exists()


def test_a_symlink_leading_out_of_the_directory_is_refused(files, tmp_path):
    outside = fake_memory_file(tmp_path / "outside.safetensors")
    (files.root / "link.safetensors").symlink_to(outside)
    (files.root / "dirlink").symlink_to(tmp_path)
    with pytest.raises(MemoryPathError, match="outside memory_dir"):
        files.resolve("link.safetensors")
    with pytest.raises(MemoryPathError, match="outside memory_dir"):
        files.resolve("dirlink/outside.safetensors")


def test_only_memory_files_are_replaced(files):
    text = files.root / "notes.txt"
    text.write_text("my notes")
    (files.root / "folder").mkdir()
    with pytest.raises(MemoryPathError, match="not a deltas_ros memory file"):
        files.for_saving(files.resolve("notes.txt"))
    with pytest.raises(MemoryPathError, match="not a regular file"):
        files.resolve("folder")
    memory = fake_memory_file(files.root / "old.safetensors")
    assert files.for_saving(files.resolve("old.safetensors")) == memory
    assert files.for_saving(files.resolve("new.safetensors")).name == "new.safetensors"
    assert text.read_text() == "my notes"


def test_header_reading_is_bounded_and_refuses_other_files(tmp_path):
    assert read_metadata(fake_memory_file(tmp_path / "m", {"extra": {"a": 1}})) == {
        "extra": {"a": 1}}
    huge = tmp_path / "huge"
    huge.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    other = tmp_path / "other.safetensors"
    raw = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    other.write_bytes(struct.pack("<Q", len(raw)) + raw)
    for path in (huge, other, tmp_path / "absent", tmp_path):
        assert not is_memory_file(path)
    with pytest.raises(MemoryPathError):
        read_metadata(other)


def test_an_absolute_memory_file_is_accepted_only_inside_memory_dir(tmp_path):
    inside = MemoryFiles(tmp_path, str(tmp_path / "kept.safetensors"))
    assert inside.default == tmp_path.resolve() / "kept.safetensors"
    with pytest.raises(MemoryPathError, match="memory_file"):
        MemoryFiles(tmp_path / "memory", str(tmp_path / "old.safetensors"))


def test_default_directory_follows_ros_home(monkeypatch, tmp_path):
    monkeypatch.setenv("ROS_HOME", str(tmp_path))
    assert default_memory_dir() == tmp_path / "deltas_ros"
    monkeypatch.delenv("ROS_HOME")
    assert default_memory_dir() == Path.home() / ".ros" / "deltas_ros"


def test_a_key_file_others_can_read_is_refused(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    assert read_key(str(key)) == key.read_bytes()
    assert read_key("") is None
    key.chmod(0o640)
    with pytest.raises(MemoryPathError, match="chmod 600"):
        read_key(str(key))
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    with pytest.raises(MemoryPathError, match="at least"):
        read_key(str(short))
    with pytest.raises(MemoryPathError, match="not a regular file"):
        read_key(str(tmp_path))
    with pytest.raises(MemoryPathError):
        read_key(str(tmp_path / "absent"))


def test_a_name_the_system_refuses_to_look_up_is_a_refusal(files):
    """A 256-character name: Path.exists() raises ENAMETOOLONG, which once ended the node."""
    with pytest.raises(MemoryPathError, match="File name too long"):
        files.resolve("a" * 256)
    with pytest.raises(MemoryPathError):
        files.resolve("x" * 5000 + "/y")


def test_saves_before_a_reset_rotate_over_a_bounded_set(files):
    used = []
    for k in range(RESET_FILES + 2):
        path = files.before_reset()
        path.write_bytes(b"memory")
        os.utime(path, ns=(k * 10**9, k * 10**9))
        used.append(path.name)
    names = [f"before-reset-{k}.safetensors" for k in range(RESET_FILES)]
    assert used == names + names[:2]  # free ones first, then the oldest replaced
    assert sorted(p.name for p in files.root.iterdir() if p.name.startswith("before")) == names
