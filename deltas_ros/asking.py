"""A question to the memory: when it is accepted, how it is decoded, where its evidence lies."""

from __future__ import annotations

import time

import torch

from .backend import Backend
from .memory_config import MemoryConfig, question_problem
from .slots import SlotTable


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


def decode(backend: Backend, hidden: torch.Tensor, position: int, limit: int,
           stop_ids: set[int], deadline: float) -> tuple[list[int], bool]:
    """Greedy decoding after the question's hidden states (1, L, hidden) until end of turn,
    `limit` tokens or the perf_counter `deadline`: (generated ids, stopped by the deadline)."""
    generated: list[int] = []
    while len(generated) < limit:
        if time.perf_counter() > deadline:
            return generated, True
        token = backend.next_token(hidden)
        if token in stop_ids:
            break
        generated.append(token)
        hidden = backend.step(token, position)
        position += 1
    return generated, False


def evidence_chunks(slots: SlotTable, mass: torch.Tensor, count: int) -> list[int]:
    """The `count` held chunks the question's attention mass (T,) per slot falls on most.

    Sized by the chunks held, not by the chunk counter (which may be large after a long run).
    """
    held = slots.chunk >= 0
    chunks, slot_of = slots.chunk[held].unique(return_inverse=True)
    per_chunk = torch.zeros(chunks.numel()).index_add_(0, slot_of, mass[held])
    k = min(count, chunks.numel())
    return chunks[per_chunk.topk(k).indices].tolist() if k else []
