"""Algorithm 1's selection the slow, obvious way: loops over slots, buckets as lists. What
`policy.select_keep` and `SlotTable.held_chunks` are tested against (test_policy,
test_memory_eviction), as fla keeps naive.py beside its kernels."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .policy import EvictionLimits
from .poses import Pose
from .slot_table import SlotTable


def select_keep_reference(times: Sequence[float], scores: Sequence[float],
                          limits: EvictionLimits) -> list[int]:
    """`policy.select_keep` as loops over slots: buckets as lists, each ranked by sort."""
    total, budget, sinks, window, buckets = (len(times), limits.budget, limits.sinks,
                                             limits.window, limits.buckets)
    if len(scores) != total:
        raise ValueError(f"{total} times but {len(scores)} scores")
    if total <= budget:
        return list(range(total))
    candidates = range(sinks, total - window)
    per_bucket: list[list[int]] = [[] for _ in range(buckets)]
    for i, b in zip(candidates, buckets_of([times[i] for i in candidates], buckets)):
        per_bucket[b].append(i)

    def best_first(slots: list[int]) -> list[int]:
        def key(i: int) -> tuple[float, float, int]:
            s = scores[i]
            return (-math.inf if math.isnan(s) else s, times[i], i)
        return sorted(slots, key=key, reverse=True)

    free = budget - sinks - window
    base, extra = divmod(free, buckets)
    kept, rest = [], []
    for b, slots in enumerate(per_bucket):
        share = base + (1 if b >= buckets - extra else 0)
        ranked = best_first(slots)
        kept += ranked[:share]
        rest += ranked[share:]
    kept += best_first(rest)[:free - len(kept)]
    return sorted(list(range(sinks)) + kept + list(range(total - window, total)))


def buckets_of(times: list[float], buckets: int) -> list[int]:
    """The equal stream-time span (of `buckets` between the least and the greatest of `times`)
    each time falls in."""
    lo, hi = min(times, default=0.0), max(times, default=0.0)
    return [0 if hi == lo else min(buckets - 1, int((t - lo) / (hi - lo) * buckets))
            for t in times]


def held_chunks_reference(table: SlotTable, limits: EvictionLimits
                          ) -> list[tuple[int, float, int, int, Pose | None]]:
    """`SlotTable.held_chunks` as a loop over chunks: (chunk, time, slots, bucket, pose) each,
    where its bucket is that of its first slot among the candidates `select_keep_reference`
    ranks."""
    order = table.arrival_order().tolist()
    times = [table.time[i].item() for i in order]
    chunks = [table.chunk[i].item() for i in order]
    candidates = range(limits.sinks, max(len(order) - limits.window, limits.sinks))
    bucket_of = dict(zip(candidates, buckets_of([times[i] for i in candidates], limits.buckets)))
    held = []
    for chunk in sorted({c for c in chunks if c >= 0}):
        slots = [i for i, c in enumerate(chunks) if c == chunk]
        bucket = next((bucket_of[i] for i in slots if i in bucket_of), -1)
        held.append((chunk, times[slots[0]], len(slots), bucket, table.poses.get(chunk)))
    return held
