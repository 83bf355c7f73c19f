"""A question to the memory: when it is accepted, how it is decoded, where its evidence lies;
and StreamMem's generic question, whose attention scores the `streammem` policy's tokens."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backend import Backend
from .config import MemoryConfig, question_problem
from .evidence_forward import (
    EVIDENCE_BATCH_BYTES,
    GATE_PASS_BYTES,
    answer_log_probs,
    evidence_rows,
    gate_gradients,
    gate_pass_bytes,
)
from .recall import choose_recall, recall_scores
from .slot_table import SlotTable
from .tiers import TierIndex


def accept_question(question: str, max_new_tokens: int | None, config: MemoryConfig,
                    ids: list[int]) -> int:
    """The answer's token limit, or ValueError; `ids` is the question as the model reads it.

    Called before anything changes, so a refused request leaves the memory as it was.
    """
    if problem := question_problem(question):
        raise ValueError(problem)
    limit = max_new_tokens or config.max_new_tokens
    if not 1 <= limit <= config.max_answer_tokens:
        raise ValueError(f"max_new_tokens {limit} is outside [1, {config.max_answer_tokens}]")
    if len(ids) > config.max_question_tokens:
        raise ValueError(f"the question has {len(ids)} tokens; the limit is "
                         f"{config.max_question_tokens}")
    return limit


def text_positions(start: int, length: int) -> torch.Tensor:
    """(3, 1, length): text tokens at positions start.. on all three rotary rows."""
    return torch.arange(start, start + length).expand(3, 1, -1)


def decode(backend: Backend, hidden: torch.Tensor, position: int, limit: int,
           stop_ids: set[int], deadline: float,
           on_token: Callable[[list[int]], None] | None = None,
           cancelled: Callable[[], bool] | None = None) -> tuple[list[int], str]:
    """Greedy decoding after the question's hidden states (1, L, hidden) until end of turn,
    `limit` tokens, the perf_counter `deadline` or `cancelled()`: (generated ids, why it stopped:
    "end", "limit", "deadline" or "cancelled").

    on_token(ids so far) is called after each token; `cancelled` is checked before each token,
    so a cancel stops decoding within one token."""
    generated: list[int] = []
    while len(generated) < limit:
        if cancelled is not None and cancelled():
            return generated, "cancelled"
        if time.perf_counter() > deadline:
            return generated, "deadline"
        token = backend.next_token(hidden)
        if token in stop_ids:
            return generated, "end"
        generated.append(token)
        if on_token is not None:
            on_token(generated)
        if len(generated) == limit:
            break
        hidden = backend.step(token, position)
        position += 1
    return generated, "limit"


@dataclass
class EvidenceSearch:
    """How an answer's evidence is found: `count` chunks reported; the `candidates` whose
    leave-one-out drop is estimated largest (`estimated_drops`) tested by leaving each out
    (0: attention mass only); restore() puts the backend back as it was before the question
    (before the estimate and the test); `batch_bytes` bounds each batched forward of the test
    (`leave_one_out_batched`); an estimate that would hold more than `estimate_bytes`
    (`gate_pass_bytes`: a long answer) is skipped, and the candidates are those the answer
    attended to most."""

    count: int
    candidates: int
    restore: Callable[[], None]
    batch_bytes: int = EVIDENCE_BATCH_BYTES
    estimate_bytes: int = GATE_PASS_BYTES


def answer_question(backend: Backend, slots: SlotTable, ids: list[int], position: int,
                    limit: int, stop_ids: set[int], deadline: float, evidence: EvidenceSearch,
                    allowed: torch.Tensor | None = None,
                    on_token: Callable[[list[int]], None] | None = None,
                    cancelled: Callable[[], bool] | None = None,
                    ) -> tuple[list[int], list[int], str]:
    """Prefill the question `ids` at `position` and decode it (see `decode`): (generated ids,
    evidence chunks (see `EvidenceSearch`), why decoding stopped). Changes the backend's states and
    KV: the caller rolls them back.

    allowed (T,) bool: the slots the question may see (None: all); the others are left out of
    the full-attention layers for this question only, and hold no evidence."""
    kv_tokens = backend.kv_tokens
    positions = text_positions(position, len(ids))
    visible = None if allowed is None else allowed.nonzero().squeeze(1)
    with backend.visible_slots(visible):
        seen = kv_tokens if visible is None else visible.numel()
        with backend.attention_mass(seen) as mass:  # the question's and the answer's tokens
            hidden = backend.prefill_text(torch.tensor([ids]), positions)
            generated, stop = decode(backend, hidden, position + len(ids), limit, stop_ids,
                                     deadline, on_token, cancelled)
    if visible is not None:  # back to one entry per slot of the whole cache
        mass = torch.zeros(kv_tokens).index_copy_(0, visible, mass)
    attended = evidence_chunks(slots, mass, max(evidence.candidates, evidence.count), allowed)
    if (not generated or not evidence.candidates or stop == "cancelled"
            or time.perf_counter() > deadline or cancelled is not None and cancelled()):
        return generated, attended[:evidence.count], stop
    evidence.restore()
    ranked = attended
    if gate_pass_bytes(backend.model.config.text_config, kv_tokens, len(ids) + len(generated),
                       len(generated), backend.dtype,
                       backend.device.type) <= evidence.estimate_bytes:
        estimates = estimated_drops(backend, slots, ids, generated, position, allowed)
        ranked = sorted(estimates, key=estimates.__getitem__, reverse=True)
    drops = leave_one_out_batched(backend, slots, ids, generated, position,
                                  ranked[:evidence.candidates], allowed, deadline, cancelled,
                                  evidence.batch_bytes)
    return generated, by_drop(ranked, drops)[:evidence.count], stop


def estimated_drops(backend: Backend, slots: SlotTable, ids: list[int], answer: list[int],
                    position: int, allowed: torch.Tensor | None) -> dict[int, float]:
    """{held chunk the question saw (`allowed`): the first-order estimate of its leave-one-out
    drop}, oldest first: its slots' `gate_gradients` summed. One forward and backward for every
    chunk, where an exact drop costs a forward row each: it decides which candidates the exact
    test spends its rows on (bench.evidence_candidates measures how well)."""
    outside = (torch.zeros_like(slots.chunk, dtype=torch.bool) if allowed is None
               else ~allowed)
    gradient = gate_gradients(backend, ids, answer, position, outside)
    held = (slots.chunk >= 0) & ~outside
    chunks, slot_of = slots.chunk[held].unique(return_inverse=True)
    per_chunk = torch.zeros(chunks.numel()).index_add_(0, slot_of, gradient[held])
    return dict(zip(chunks.tolist(), per_chunk.tolist()))


def leave_one_out_batched(backend: Backend, slots: SlotTable, ids: list[int], answer: list[int],
                          position: int, candidates: list[int], allowed: torch.Tensor | None,
                          deadline: float, cancelled: Callable[[], bool] | None = None,
                          batch_bytes: int = EVIDENCE_BATCH_BYTES) -> dict[int, float]:
    """`asking_reference.leave_one_out`'s drops from batched forwards over the memory's cache
    as it is: row 0 hides nothing but what `allowed` leaves out, row i + 1 also candidate i's
    slots, by the attention mask (`evidence_forward.answer_log_probs`); as many rows a forward as
    `evidence_rows` fits in `batch_bytes`. No K/V copy per candidate, and the backend is only
    read, so it needs no restore. Stops before a batch at `deadline` or `cancelled()`: the
    candidates of the batches run are tested (all of them when one batch holds them), the
    others not."""
    outside = (torch.zeros_like(slots.chunk, dtype=torch.bool) if allowed is None
               else ~allowed)
    rows = [outside, *(outside | (slots.chunk == chunk) for chunk in candidates)]
    length = len(ids) + len(answer)
    per_batch = evidence_rows(batch_bytes, backend.model.config.text_config, len(outside),
                              length, len(answer), backend.dtype, len(rows))
    log_probs: list[float] = []
    for start in range(0, len(rows), per_batch):
        if time.perf_counter() > deadline or cancelled is not None and cancelled():
            break
        log_probs += answer_log_probs(backend, ids, answer, position,
                                      torch.stack(rows[start:start + per_batch]))
    return {chunk: log_probs[0] - log_prob
            for chunk, log_prob in zip(candidates, log_probs[1:])}


def proxy_saliency(backend: Backend, ids: torch.Tensor, positions: torch.Tensor,
                   slots: int) -> torch.Tensor:
    """(slots,) mean attention the proxy tokens put on each cache slot, the forward undone.

    ids (1, L), positions (3, 1, L): the generic query (the assistant-turn opening) after the
    stream. The forward runs over the live cache with the attention-mass hooks inside
    `Backend.undone`, so the memory is as before. The mass is divided by layers x heads x
    queries: each query's softmax sums to 1.
    """
    with backend.undone(), backend.attention_mass(slots) as mass:
        backend.prefill_text(ids, positions)
    heads = backend.model.config.text_config.num_attention_heads
    return mass / (len(backend.full) * heads * ids.shape[1])


def recall_chunks(backend: Backend, index: TierIndex, ids: list[int], position: int,
                  visible: torch.Tensor | None, since: float | None, until: float | None,
                  budget: int, every_layer: bool = False) -> list[int]:
    """The tiered chunks a question calls back (oldest first): its queries score each tiered
    chunk of the window [since, until], and the best are taken up to `budget` tokens
    (recall.choose_recall).

    The queries are the first full-attention layer's (`Backend.first_queries`): below it
    every layer is linear attention, so they are what the question's own prefill will compute
    there whatever the view holds, and a forward of a few layers finds them. every_layer: every
    full-attention layer's, from a whole prefill of `ids` over the GPU tier's `visible` slots
    (undone), where the deeper layers' queries have read the GPU tier (bench.recall compares
    the two)."""
    inside = torch.ones(len(index.chunks), dtype=torch.bool)
    if since is not None:
        inside &= index.times >= since
    if until is not None:
        inside &= index.times <= until
    if budget <= 0 or not inside.any():
        return []
    text, positions = torch.tensor([ids]), text_positions(position, len(ids))
    picked = inside.nonzero().squeeze(1)
    if every_layer:
        if index.summaries.shape[1] != len(backend.full):
            raise ValueError("every layer's queries need every layer's key summaries "
                             "(recall.summarizer(..., every_layer=True))")
        with backend.undone(), backend.visible_slots(visible), backend.question_queries() as q:
            backend.prefill_text(text, positions)
        scores = recall_scores(torch.stack(q), index.summaries[picked])
    else:
        queries = backend.first_queries(text, positions).unsqueeze(0)
        scores = recall_scores(queries, index.summaries[:, :1][picked])
    return [index.chunks[int(picked[i])]
            for i in choose_recall(scores, index.tokens[picked], budget)]


def by_drop(candidates: list[int], drops: dict[int, float]) -> list[int]:
    """The tested candidates, largest drop first (ties keep their order), then the untested
    ones in their order."""
    tested = sorted(drops, key=drops.__getitem__, reverse=True)
    return tested + [chunk for chunk in candidates if chunk not in drops]


def window_slots(slots: SlotTable, since: float | None, until: float | None) -> torch.Tensor:
    """(T,) bool: the slots a question over stream times [since, until] may attend to: the chat
    prefix and the slots of the held chunks whose stream time lies in the window (inclusive;
    None leaves that side open). ValueError when no held chunk lies in it or since > until."""
    if since is not None and until is not None and since > until:
        raise ValueError(f"the window's since ({since}) is after its until ({until})")
    for name, bound in (("since", since), ("until", until)):
        if bound is not None and not math.isfinite(bound):
            raise ValueError(f"the window's {name} must be finite, not {bound}")
    inside = slots.chunk >= 0
    if since is not None:
        inside &= slots.time >= since
    if until is not None:
        inside &= slots.time <= until
    if not inside.any():
        span = slots.span()
        raise ValueError(f"no retained chunk lies in the window [{since}, {until}] "
                         f"(the memory holds stream times {span[0]:.2f}..{span[1]:.2f} s)")
    return inside | (slots.chunk < 0)


def evidence_chunks(slots: SlotTable, mass: torch.Tensor, count: int,
                    allowed: torch.Tensor | None = None) -> list[int]:
    """The `count` held chunks the attention mass (T,) per slot (of the question and its answer)
    falls on most, among the slots `allowed` (T,) bool (all when None).

    Sized by the chunks held, not by the chunk counter (which may be large after a long run).
    """
    held = slots.chunk >= 0
    if allowed is not None:
        held &= allowed
    chunks, slot_of = slots.chunk[held].unique(return_inverse=True)
    per_chunk = torch.zeros(chunks.numel()).index_add_(0, slot_of, mass[held])
    k = min(count, chunks.numel())
    return chunks[per_chunk.topk(k).indices].tolist() if k else []
