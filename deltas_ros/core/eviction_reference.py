"""The eviction the slow, obvious way: what `StreamingMemory.evict_to_budget` and
`SlotTable.keep_slots` are tested against (test_memory_eviction, test_rope), as fla keeps
naive.py beside its kernels: every kept slot gathered in arrival order, or moved one index per
slot."""

from __future__ import annotations

import numpy as np
import torch

from .kv_ops_reference import gather_cache
from .memory import StreamingMemory
from .slot_table import SlotTable


def fill_plan(kept: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(holes, movers) for keeping slots `kept` of `total` by moving as few as possible, one
    index per slot: what `SlotTable.keep_slots` pairs as ranges.

    The cache shrinks to size = len(kept) slots; the evicted slots below `size` are holes, and
    the kept slots at or above `size` (as many) move into them. Both are sorted (T,) int64 host
    index tensors of equal length.
    """
    size = kept.numel()
    keep = np.zeros(total, dtype=bool)
    keep[kept.numpy()] = True
    holes = np.flatnonzero(~keep[:size])
    movers = np.flatnonzero(keep[size:]) + size
    return torch.from_numpy(holes), torch.from_numpy(movers)


def gather_table(table: SlotTable, keep: torch.Tensor) -> SlotTable:
    """The table of the slots `keep` (sorted slot indices), in that order."""
    keep = keep.cpu()
    chunk = table.chunk[keep]
    stamps, poses = table.held(chunk)
    return SlotTable(table.time[keep], table.score[keep], chunk, table.position[:, keep],
                     stamps, table.arrival[keep], table.next_arrival, poses)


def fill_table(table: SlotTable, holes: torch.Tensor, movers: torch.Tensor,
               size: int) -> SlotTable:
    """The table after the slots `movers` moved into `holes` one index each and the cut to
    `size` slots (`fill_plan`)."""
    holes, movers = np.asarray(holes), np.asarray(movers)

    def moved(row: torch.Tensor) -> torch.Tensor:
        data = row.numpy()
        out = data[..., :size].copy()
        out[..., holes] = data[..., movers]
        return torch.from_numpy(out)

    chunk = moved(table.chunk)
    stamps, poses = table.held(chunk)
    return SlotTable(moved(table.time), moved(table.score), chunk, moved(table.position),
                     stamps, moved(table.arrival), table.next_arrival, poses)


def gather_evict(memory: StreamingMemory) -> int:
    """`StreamingMemory.evict_to_budget` by the obvious path: the same choice of slots
    (`slots_to_keep`), every kept slot gathered in slot order. Returns the slots evicted."""
    total = memory.kv_tokens
    if (kept := memory.slots_to_keep()) is None:
        return 0
    kept = kept.sort().values
    with torch.inference_mode():
        gather_cache(memory.backend, kept)
    memory.slots = gather_table(memory.slots, kept)
    return total - len(memory.slots)
