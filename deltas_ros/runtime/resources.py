"""What the process holds, and giving back what nothing refers to: measured around a cleanup
so that a log says what freeing the model and the memory gave back."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch


def memory_in_use() -> dict[str, int]:
    """Bytes this process holds: `rss` (Linux), and `cuda_allocated` once CUDA is in use."""
    use = {}
    status = Path("/proc/self/status")
    if status.exists():
        rss = [line for line in status.read_text().splitlines() if line.startswith("VmRSS:")]
        use["rss"] = int(rss[0].split()[1]) * 1024 if rss else 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        use["cuda_allocated"] = torch.cuda.memory_allocated()
    return use


def release_memory() -> None:
    """Give what nothing refers to any more back to the system: collect cycles, empty torch's
    CUDA cache, and trim glibc's heap (freed small blocks otherwise stay in the process)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
