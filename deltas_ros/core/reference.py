"""The slow, obvious versions the fast paths are tested against, as fla keeps naive.py.

Each writes a rule of the method the plain way: loops over slots, one layer at a time, every
kept slot copied, one forward per evidence candidate. Nothing in production calls them; tests
compare each with its fast path on random inputs and on the model itself, and the benches time
both side by side.

    fast path                          reference
    policy.select_keep / select_runs   select_keep_reference
    SlotTable.held_chunks              held_chunks_reference
    drift.state_drift                  state_drift_reference
    signals.state_surprise             state_surprise_reference
    signals.temporal_redundancy        temporal_redundancy_reference
    kv_slots.attention_mass_of         attention_mass_reference
    StreamingMemory.evict_to_budget    gather_evict (gather_table + gather_cache)
    SlotTable.keep_slots / keep_runs   fill_plan + fill_table, fill_cache
    asking.leave_one_out_batched       leave_one_out
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .asking import text_positions
from .backend import Backend
from .config import MemoryConfig
from .drift import check_states, drift_ratio
from .kv_slots import fill_slots, gather_slots
from .policy import check_limits, select_keep
from .slots import SlotTable

if TYPE_CHECKING:
    from .memory import StreamingMemory
    from .poses import Pose


def select_keep_reference(
    times: Sequence[float], scores: Sequence[float], budget: int,
    sinks: int = MemoryConfig.sink_tokens, window: int = MemoryConfig.window_tokens,
    buckets: int = MemoryConfig.buckets,
) -> list[int]:
    """`policy.select_keep` as loops over slots: buckets as lists, each ranked by sort."""
    total = len(times)
    check_limits(total, len(scores), budget, sinks, window, buckets)
    if total <= budget:
        return list(range(total))
    candidates = list(range(sinks, total - window))
    lo, hi = min(times[i] for i in candidates), max(times[i] for i in candidates)
    per_bucket: list[list[int]] = [[] for _ in range(buckets)]
    for i in candidates:
        b = 0 if hi == lo else min(buckets - 1, int((times[i] - lo) / (hi - lo) * buckets))
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


def held_chunks_reference(table: SlotTable, sinks: int, window: int,
                          buckets: int) -> list[tuple[int, float, int, int, Pose | None]]:
    """`SlotTable.held_chunks` as a loop over chunks: (chunk, time, slots, bucket, pose) each,
    where its bucket is that of its first slot among the candidates `select_keep_reference`
    ranks."""
    order = table.arrival_order().tolist()
    times = [table.time[i].item() for i in order]
    chunks = [table.chunk[i].item() for i in order]
    candidates = range(sinks, max(len(order) - window, sinks))
    lo = min((times[i] for i in candidates), default=0.0)
    hi = max((times[i] for i in candidates), default=0.0)
    held = []
    for chunk in sorted({c for c in chunks if c >= 0}):
        slots = [i for i, c in enumerate(chunks) if c == chunk]
        bucket = -1
        for i in slots:
            if i in candidates:
                bucket = 0 if hi == lo else min(buckets - 1,
                                                int((times[i] - lo) / (hi - lo) * buckets))
                break
        held.append((chunk, times[slots[0]], len(slots), bucket, table.poses.get(chunk)))
    return held


def state_drift_reference(
    before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]
) -> tuple[float, list[float]]:
    """`drift.state_drift`: Eq. 3 one layer at a time, exactly as written."""
    check_states(before, after)
    per_layer = []
    for b, a in zip(before, after):
        b, a = b.float(), a.float()
        ratio = drift_ratio(torch.linalg.vector_norm(a - b), torch.linalg.vector_norm(b),
                       torch.linalg.vector_norm(a))
        per_layer.append(ratio.item())
    return sum(per_layer) / len(per_layer), per_layer


def attention_mass_reference(queries: torch.Tensor, keys: torch.Tensor, scaling: float,
                             groups: int, slots: int) -> torch.Tensor:
    """`kv_slots.attention_mass_of` in one piece (all L x S logits at once)."""
    length, total = queries.shape[2], keys.shape[2]
    keys = keys.repeat_interleave(groups, dim=1)
    logits = torch.matmul(queries, keys.transpose(2, 3)) * scaling
    causal = torch.ones(length, total, dtype=torch.bool).tril(total - length)
    logits = logits.masked_fill(~causal.to(logits.device), float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(queries.dtype)
    return weights[0, :, :, :slots].float().sum((0, 1))


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


def gather_cache(backend: Backend, keep: torch.Tensor) -> None:
    """Keep only slots `keep` (sorted indices) in every full-attention layer, every kept slot
    copied in order."""
    keep = keep.to(backend.device)
    backend.replace_kv([gather_slots(cache, keep) for cache in backend.kv_tensors()])


def fill_cache(backend: Backend, holes: torch.Tensor, movers: torch.Tensor, size: int) -> None:
    """`Backend.move` one index per slot: the slots `movers` into `holes`, cut to `size`."""
    backend.replace_kv(fill_slots(backend.kv_tensors(), backend.device_index(holes),
                                  backend.device_index(movers), size))


def gather_evict(memory: StreamingMemory) -> int:
    """`StreamingMemory.evict_to_budget` by the obvious path: every slot scored and sorted
    (select_keep), every kept slot gathered in arrival order. Returns the slots evicted."""
    total, cfg = memory.kv_tokens, memory.config
    if total <= cfg.budget_tokens:
        return 0
    order = memory.slots.arrival_order().numpy()
    chosen = select_keep(memory.slots.time.numpy()[order], memory.slots.score.numpy()[order],
                         cfg.budget_tokens, cfg.sink_tokens, cfg.window_tokens,
                         memory.policy.buckets or cfg.buckets)
    kept = torch.from_numpy(order[chosen.numpy()]).sort().values
    with torch.inference_mode():
        gather_cache(memory.backend, kept)
    memory.slots = gather_table(memory.slots, kept)
    return total - len(memory.slots)


def answer_log_prob(backend: Backend, ids: list[int], answer: list[int], position: int,
                    visible: torch.Tensor | None) -> float:
    """log p(answer | question `ids`, the slots `visible`): one teacher-forced forward of the
    question and the answer at `position`. Changes the backend's states and KV."""
    tokens = ids + answer
    positions = text_positions(position, len(tokens))
    with backend.visible_slots(visible):
        hidden = backend.prefill_text(torch.tensor([tokens]), positions)
    return backend.log_prob(hidden[:, len(ids) - 1:-1], answer)


def leave_one_out(backend: Backend, slots: SlotTable, ids: list[int], answer: list[int],
                  position: int, candidates: list[int], allowed: torch.Tensor | None,
                  restore: Callable[[], None], deadline: float,
                  cancelled: Callable[[], bool] | None = None) -> dict[int, float]:
    """{chunk: how much hiding its slots from the full-attention layers lowers log p(answer)},
    for the `candidates` (held chunks) in their order until `deadline` (perf_counter) or
    `cancelled()`, as the question saw the memory (`allowed`). One forward each (plus one with
    nothing hidden), each on a copy of the K/V without the chunk (as a windowed question); the
    backend is restored after each.

    `asking.leave_one_out_batched`, which questions use, one candidate at a time over a
    gathered copy (test_evidence compares them, bench.real_size times both)."""
    seen = torch.ones_like(slots.chunk, dtype=torch.bool) if allowed is None else allowed

    def log_prob(hidden_chunk: int | None) -> float:
        visible = seen if hidden_chunk is None else seen & (slots.chunk != hidden_chunk)
        try:
            return answer_log_prob(backend, ids, answer, position,
                                   None if visible.all() else visible.nonzero().squeeze(1))
        finally:
            restore()

    full = log_prob(None)
    drops: dict[int, float] = {}
    for chunk in candidates:
        if time.perf_counter() > deadline or cancelled is not None and cancelled():
            break
        drops[chunk] = full - log_prob(chunk)
    return drops


def state_surprise_reference(
    key: torch.Tensor, value: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """`signals.state_surprise` token by token and head by head: key (B, n, Hk, dk), value
    (B, n, Hv, dv), beta (B, n, Hv), initial_state (B, Hv, dk, dv) or None; returns (B, n).
    Value head h reads key head h // (Hv / Hk); keys l2-normalised as the kernel does."""
    batch, length, heads, dv = value.shape
    group = heads // key.shape[2]
    out = torch.zeros(batch, length)
    for b in range(batch):
        for t in range(length):
            written, scale = 0.0, 0.0
            for h in range(heads):
                k = key[b, t, h // group].double()
                k = k / torch.sqrt((k * k).sum() + 1e-6)
                v = value[b, t, h].double()
                retrieved = (torch.zeros(dv, dtype=torch.float64) if initial_state is None
                             else initial_state[b, h].double().T @ k)
                written += float(((beta[b, t, h].double() * (v - retrieved)) ** 2).sum())
                scale += float((v * v).sum())
            out[b, t] = math.sqrt(written) / math.sqrt(scale) if scale > 0 else 0.0
    return out


def temporal_redundancy_reference(keys: Sequence[torch.Tensor],
                                  previous: Sequence[torch.Tensor] | None) -> list[float]:
    """`signals.temporal_redundancy` one layer, head and place at a time."""
    n = keys[0].shape[2]
    if previous is None:
        return [0.0] * n
    m = min(n, previous[0].shape[2])
    out = [0.0] * n
    for i in range(n - m, n):
        j = previous[0].shape[2] - (n - i)
        sims = [float(torch.nn.functional.cosine_similarity(k[0, h, i].double(),
                                                            p[0, h, j].double(), dim=0))
                for k, p in zip(keys, previous) for h in range(k.shape[1])]
        out[i] = sum(sims) / len(sims)
    return out
