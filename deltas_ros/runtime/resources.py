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


M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def limit_malloc_arenas(arenas: int = 1) -> bool:
    """Make glibc's malloc keep at most `arenas` heaps for all threads; whether it took.

    Called before the node's threads start. By default each thread that allocates gets a heap
    of its own (up to 8 per core); a configure, the worker and the executor threads change
    from cycle to cycle, and what a freed model left in one thread's heap was not always given
    back (`bench.cleanup_memory --node`: 62 and 166 MiB more after each later cleanup of a
    0.8B model, once the whole 3.3 GiB model after the first; with one heap, 0.5 and 4.8).
    The tensors are large blocks, so threads rarely wait on the shared heap's lock."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc
        return False


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
