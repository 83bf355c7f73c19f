"""Where the node may read and write memory files: one directory, and an optional key file.

Any participant on the DDS domain can call ~/save_memory and ~/load_memory, so a request must not
choose where the node (with its user's rights) writes. The rules (docs/reliability.md):

- Every memory file lies inside `memory_dir`. A request names a file in it ("run3.safetensors")
  or a path that resolves inside it: no `..`, no symlink that leads out, no absolute path outside.
- No folder is created for a request: a name in a sub-folder needs that sub-folder to exist.
- An existing file is replaced only when it is a memory file (its safetensors header holds the
  deltas_ros metadata key); a text file, a folder or a device is never overwritten.
- `memory_key_file` (optional) holds the key of the files' keyed checksum; it must be a regular
  file owned by the node's user and readable by nobody else, or the node refuses to start.

No rclpy and no torch here: the rules are tested on their own (test/runtime/test_files.py).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

METADATA_KEY = "deltas_ros.memory"  # persistence.METADATA_KEY (not imported: that pulls in torch)
DEFAULT_NAME = "memory.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header
MIN_KEY_BYTES = 16
RESET_FILES = 3  # saves kept of memories a time jump reset: before-reset-<k>.safetensors


class MemoryPathError(ValueError):
    """A request for a memory file the node must not read or write; the message says why."""


def default_memory_dir() -> Path:
    """$ROS_HOME/deltas_ros, as ROS tools place their files ($ROS_HOME defaults to ~/.ros)."""
    return Path(os.environ.get("ROS_HOME", Path.home() / ".ros")).expanduser() / "deltas_ros"


def memory_directory(memory_dir: str | Path) -> Path:
    """The directory the memory_dir parameter names (empty: the default one), not created."""
    return Path(memory_dir).expanduser() if memory_dir else default_memory_dir()


class MemoryFiles:
    """Resolves requested file names inside `directory` (created at start if missing, 0700)."""

    def __init__(self, directory: str | Path, default_file: str = "") -> None:
        self.directory = memory_directory(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root = self.directory.resolve(strict=True)
        if not self.root.is_dir():
            raise MemoryPathError(f"memory_dir {self.directory} is not a directory")
        # An old absolute memory_file is accepted if it lies inside memory_dir (refused at start
        # otherwise, with the fix): a name relative to the directory is what is stored.
        self.default = self.resolve(default_file or DEFAULT_NAME, checking="memory_file")

    def resolve(self, requested: str, checking: str = "the requested path") -> Path:
        """The file `requested` names inside the directory ("" = the default file).

        Raises MemoryPathError if it leads outside, into a missing folder, or to a folder, or
        if the system refuses to look it up (a name too long, a folder not searchable).
        """
        if not requested:
            return self.default
        try:
            return self._resolve(requested, checking)
        except OSError as error:
            raise MemoryPathError(f"{checking} {requested[:100]!r}: {error.strerror}") from None

    def _resolve(self, requested: str, checking: str) -> Path:
        if "\x00" in requested:
            raise MemoryPathError(f"{checking} contains a NUL character")
        given = Path(requested).expanduser()
        if ".." in given.parts:
            raise MemoryPathError(f"{checking} {requested!r} contains '..'; give a file name "
                                  f"inside memory_dir ({self.root})")
        # resolve() follows every symlink, so a link inside the directory that points out of it
        # is caught by the containment check below.
        path = (self.root / given).resolve()
        if path == self.root or not path.is_relative_to(self.root):
            raise MemoryPathError(f"{checking} {requested!r} is outside memory_dir ({self.root}); "
                                  "give a file name inside it")
        if not path.parent.is_dir():
            raise MemoryPathError(f"{checking} {requested!r}: folder {path.parent} does not "
                                  "exist (folders are not created for a request)")
        if path.exists() and not path.is_file():
            raise MemoryPathError(f"{checking} {requested!r} is not a regular file")
        return path

    def before_reset(self) -> Path:
        """Where a memory a time jump is about to reset is saved: the first free one of
        before-reset-0 .. RESET_FILES-1, else the oldest of them (replaced)."""
        paths = [self.root / f"before-reset-{k}.safetensors" for k in range(RESET_FILES)]
        free = [path for path in paths if not path.exists()]
        return free[0] if free else min(paths, key=lambda path: path.stat().st_mtime_ns)

    def for_saving(self, path: Path) -> Path:
        """`path` if a save may write it: absent, or an existing memory file (checked now, on
        the thread that saves, right before writing)."""
        if path.exists() and not is_memory_file(path):
            raise MemoryPathError(f"{path} exists and is not a deltas_ros memory file: "
                                  "not replaced")
        return path

    def for_loading(self, path: Path) -> Path:
        if not path.is_file():
            raise MemoryPathError(f"no memory file {path.name!r} in memory_dir ({self.root})")
        return path


def is_memory_file(path: Path) -> bool:
    """Whether `path` is a safetensors file whose header carries deltas_ros memory metadata."""
    try:
        read_metadata(path)
    except MemoryPathError:
        return False
    return True


def read_metadata(path: Path) -> dict:
    """The deltas_ros JSON metadata of a memory file, from its header alone (bounded read: an
    8-byte little-endian length, then that much JSON); MemoryPathError if there is none. Not
    verified: persistence.load_memory checks the whole file."""
    try:
        with open(path, "rb") as file:
            prefix = file.read(8)
            (length,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (0,)
            if not 2 <= length <= MAX_HEADER_BYTES:
                raise MemoryPathError(f"{path.name} is not a safetensors file")
            header = json.loads(file.read(length))
            metadata = json.loads(header["__metadata__"][METADATA_KEY])
    except (OSError, ValueError, KeyError, TypeError) as error:
        if isinstance(error, MemoryPathError):
            raise
        raise MemoryPathError(f"{path.name} is not a deltas_ros memory file") from error
    if not isinstance(metadata, dict):
        raise MemoryPathError(f"{path.name} is not a deltas_ros memory file")
    return metadata


def read_key(key_file: str) -> bytes | None:
    """The key in `key_file` (None when no file is configured).

    Refuses (MemoryPathError) a key others could read or replace: the file must be a regular file
    owned by this user with no group/other permissions, and hold at least MIN_KEY_BYTES bytes.
    """
    if not key_file:
        return None
    path = Path(key_file).expanduser()
    try:
        info = path.stat()
    except OSError as error:
        raise MemoryPathError(f"memory_key_file {path}: {error.strerror}") from error
    if not stat.S_ISREG(info.st_mode):
        raise MemoryPathError(f"memory_key_file {path} is not a regular file")
    if info.st_uid != os.getuid():
        raise MemoryPathError(f"memory_key_file {path} is owned by uid {info.st_uid}, not by "
                              f"this node's user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise MemoryPathError(f"memory_key_file {path} has mode {info.st_mode & 0o777:o}: "
                              f"others may read it; run chmod 600 {path}")
    key = path.read_bytes()
    if len(key) < MIN_KEY_BYTES:
        raise MemoryPathError(f"memory_key_file {path} holds {len(key)} bytes; at least "
                              f"{MIN_KEY_BYTES} are needed (e.g. head -c 32 /dev/urandom)")
    return key
