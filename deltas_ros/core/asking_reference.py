"""The evidence search the slow, obvious way: what `asking.leave_one_out_batched` is tested
against (test_evidence_forward) and timed beside (bench.real_size), as fla keeps naive.py beside
its kernels: one forward per candidate, each over a gathered copy of the K/V without it; and
the drop estimates that rank the candidates, by finite differences instead of a backward."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .asking import text_positions
from .backend import Backend
from .evidence_forward import biased_log_prob
from .slot_table import SlotTable


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
    gathered copy (test_evidence_forward compares them, bench.real_size times both)."""
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


def estimated_drops_by_differences(backend: Backend, slots: SlotTable, ids: list[int],
                                   answer: list[int], position: int,
                                   allowed: torch.Tensor | None,
                                   step: float = 0.1) -> dict[int, float]:
    """`asking.estimated_drops` by central differences: per held chunk the question saw, log p
    with its slots' attention logits raised and lowered by `step` (`biased_log_prob`), two
    forwards a chunk instead of one backward for all. The step is large enough that float32
    rounding of log p stays below the curvature's error (both about 1e-3 of the slopes)."""
    outside = (torch.zeros_like(slots.chunk, dtype=torch.bool) if allowed is None
               else ~allowed)
    estimates: dict[int, float] = {}
    for chunk in slots.chunk[(slots.chunk >= 0) & ~outside].unique().tolist():
        slope = (slots.chunk == chunk).float() * step
        up, down = (float(biased_log_prob(backend, ids, answer, position, outside, sign * slope))
                    for sign in (1, -1))
        estimates[chunk] = (up - down) / (2 * step)
    return estimates
