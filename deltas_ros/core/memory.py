"""The DeltaS streaming memory: a Qwen3.5 hybrid model's state and KV cache kept within budget.

    memory = StreamingMemory(load_model(path), MemoryConfig(budget_tokens=8192))
    memory.add_chunk([frame0, frame1], [t0, t1])   # one second of RGB frames at 2 fps
    memory.ask("What did the robot see on the table?")

After every chunk (Algorithm 1): snapshot the Gated DeltaNet states, prefill the chunk, score it
by state drift, and while the KV cache holds more than M tokens keep the sinks, the recent window
and per temporal bucket the best-scored tokens, at their positions (keys are cached rotated);
near max_position_embeddings the slots are compacted to gap-free positions (rope.py).

The stream lives inside one open user turn of the chat template. A question closes that turn,
is answered greedily and rolled back: the states are restored from a fixed-size snapshot and
the KV cache is cut to its old length; a failed chunk is rolled back the same way. This class
only orchestrates: the model is reached through `backend`, per-slot bookkeeping is
`slot_table.SlotTable`, the choice `policy`, questions `asking`, loaded states `state_check`.
"""

from __future__ import annotations

import math
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np
import torch

from .asking import (
    EvidenceSearch,
    accept_question,
    answer_question,
    proxy_saliency,
    recall_chunks,
    window_slots,
)
from .backend import Backend, StateSnapshot
from .chunks import Chunk, ChunkBuilder
from .config import (
    ChunkFailed,
    MemoryConfig,
    QuestionFailed,
    question_problem,
)
from .loader import LoadedModel, stop_token_ids
from .policy import ChunkSignals, EvictionLimits, make_policy, select_keep
from .poses import Pose
from .prompt import THINK_END, ChatLayout
from .results import Answer, ChunkResult, MemoryState, MemoryStats
from .signals import layer_mean
from .slot_table import PREFIX_CHUNK, ChunkSlots, SlotTable
from .state_check import check_state
from .tiers import DISK, Evicted, TierPiece, TierStore

if TYPE_CHECKING:
    from .frames import SampledChunk

__all__ = ["Answer", "ChunkFailed", "ChunkResult", "MemoryConfig", "MemoryState", "MemoryStats",
           "PREFIX_CHUNK", "QuestionFailed", "StreamingMemory", "question_problem"]


# How long a question waits for the second tier's writer to place what evictions queued.
TIER_FLUSH_S = 1.0


class _Snapshot(NamedTuple):
    """What a chunk or a question may change (the slot table is immutable: by reference), and
    when copying the states started and ended (backend.now: part of a chunk's signal_ms; the
    end is also when the chunk's forward starts, so a chunk waits for the device twice, not
    three times)."""
    states: StateSnapshot
    next_position: int
    chunks_seen: int
    slots: SlotTable
    started: float
    taken: float


class StreamingMemory:
    """Bounded video memory over one Qwen3.5 model (batch size 1, not thread-safe)."""

    def __init__(self, loaded: LoadedModel, config: MemoryConfig | None = None) -> None:
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.device = loaded.device
        self.config = config or MemoryConfig()
        self.policy = make_policy(self.config.policy, self.config.seed)
        self.builder = ChunkBuilder.for_model(self.model, self.tokenizer, self.config.pixel_budget)
        self.backend = Backend(self.model, self.device, loaded.dtype)
        self.max_positions = self.backend.max_positions
        self.stop_ids = stop_token_ids(loaded.path, self.tokenizer)
        self.layout = ChatLayout.from_tokenizer(self.tokenizer, self.config.thinking)
        # Where a reasoning block ends (None: the answer is all that is generated).
        self._think_end = self.tokenizer.convert_tokens_to_ids(THINK_END) \
            if self.layout.opens_reasoning else None
        # The second tier (None: evicted is gone); its writer thread ends with the memory.
        self.tiers = TierStore.for_config(self.config)
        if self.tiers is not None:
            self.tiers.rotate = self.backend.rotary_shift
            weakref.finalize(self, self.tiers.close)  # a memory not closed still stops it
        self.reset()

    # ----------------------------------------------------------------------------- streaming
    @torch.inference_mode()
    def reset(self) -> None:
        """Forget everything and open a new stream with the chat prefix (the attention sinks)."""
        self.backend.reset()
        self.policy.reset()
        if self.tiers is not None:
            self.tiers.clear()
        self.chunks_seen = self.compactions = 0
        ids, positions = self.builder.text(self.layout.prefix, 0)
        self.backend.prefill_text(ids, positions)
        self.next_position = positions.max().item() + 1
        # The chat framing is never evicted: +inf score, stream time 0.
        self.slots = SlotTable().append(0.0, PREFIX_CHUNK, torch.full((ids.shape[1],), math.inf),
                                        positions)

    @torch.inference_mode()
    def add_chunk(
        self, frames: Sequence[np.ndarray], times: Sequence[float], stamp: float | None = None,
        pose: Pose | None = None,
    ) -> ChunkResult:
        """Ingest one chunk: RGB uint8 frames (H x W x 3) and their stream times in seconds.

        stamp: the last frame's header stamp (s), reported back as evidence; pose: the robot's
        pose at that stamp, kept with the chunk. Bad frames raise ValueError before anything
        changes. A failure while ingesting (e.g. out of memory) rolls the chunk back and raises
        ChunkFailed; a compaction the chunk needed first stays (it is complete on its own)."""
        chunk = self.builder.build(frames, times, self.next_position)
        freed = self._make_room(chunk.next_position - self.next_position,
                                self.config.compact_margin)
        if freed:
            chunk = replace(chunk, position_ids=chunk.position_ids - freed,
                            next_position=chunk.next_position - freed)
        return self._rolled_back_on_failure(
            lambda snapshot: self._ingest(chunk, stamp, snapshot, freed, pose, frames),
            ChunkFailed, f"chunk {self.chunks_seen}")

    def add_sampled(self, chunk: SampledChunk, pose: Pose | None = None) -> ChunkResult:
        """Ingest a chunk the frame sampler completed, stamped with its last frame's stamp: the
        one call the node's worker and offline runs make for each chunk."""
        return self.add_chunk(chunk.frames, chunk.times, stamp=chunk.stamps[-1], pose=pose)

    def _ingest(
        self, chunk: Chunk, stamp: float | None, snapshot: _Snapshot, freed: int,
        pose: Pose | None = None, frames: Sequence[np.ndarray] = (),
    ) -> ChunkResult:
        """Prefill, score and evict; may leave the memory half-updated if it raises."""
        t1 = snapshot.taken
        records = self.policy.records
        with self.backend.recording_write_strength(records is not None, records) as recorded:
            self.backend.prefill_chunk(chunk)
        t2 = self.backend.now()
        drift, per_layer = self.backend.drift(snapshot.states)
        t3 = self.backend.now()
        index = self.chunks_seen
        keys, values = self.backend.newest(chunk.num_tokens)
        per_token = layer_mean(recorded) if recorded else None
        signals = ChunkSignals(
            index=index, num_tokens=chunk.num_tokens, drift=drift, keys=keys, values=values,
            write_strength=None if per_token is None else per_token.mean().item(),
            recorded=per_token, frames=frames,
            saliency=self.saliency(chunk) if self.policy.needs_saliency else None)
        self.slots = self.slots.append(chunk.time, index, self.policy.score(signals),
                                       chunk.position_ids, stamp, pose)
        self.chunks_seen += 1
        self.next_position = chunk.next_position
        t4 = self.backend.now()
        evicted = self.evict_to_budget()
        t5 = self.backend.now()
        return ChunkResult(
            index=index, time=chunk.time, drift=drift, layer_drift=per_layer,
            chunk_tokens=chunk.num_tokens, kv_tokens=self.kv_tokens, evicted_tokens=evicted,
            forward_ms=(t2 - t1) * 1e3,
            signal_ms=(snapshot.taken - snapshot.started + t3 - t2) * 1e3,
            evict_ms=(t5 - t4) * 1e3 if evicted else 0.0, stamp=stamp, positions_freed=freed,
            pose=pose,
        )

    def saliency(self, chunk: Chunk) -> torch.Tensor:
        """(n,) StreamMem's proxy-query attention on `chunk`, just prefilled (the memory is left
        as it was); only for the policies that score by it."""
        ids, positions = self.builder.text(self.layout.after_question, chunk.next_position)
        return proxy_saliency(self.backend, ids, positions, self.kv_tokens)[-chunk.num_tokens:]

    @property
    def limits(self) -> EvictionLimits:
        """The eviction's limits under the config as it is now (a policy may pin the buckets)."""
        return EvictionLimits.of(self.config, self.policy.buckets)

    @torch.inference_mode()
    def evict_to_budget(self) -> int:
        """Algorithm 1, lines 6-10 (after each chunk; also after lowering budget_tokens): slots
        evicted. The kept slots are chosen over the slots in arrival order (select_keep); the
        evicted slots below the new size are filled by kept ones from above it, as slot-range
        moves (O(evicted)). A failure changes nothing: the backend reads every layer before it
        writes. eviction_reference.gather_evict is the slow version."""
        total = self.kv_tokens
        if (kept := self.slots_to_keep()) is None:
            return 0
        if self.tiers is not None:
            self._to_tiers(kept)
        slots, moves = self.slots.keep_slots(kept)
        self.backend.move(moves, len(slots))
        self.slots = slots
        return total - len(slots)

    def _to_tiers(self, kept: torch.Tensor) -> None:
        """Queue the held chunks' slots an eviction lets go (all but `kept`) for the second
        tier, as cached (the writer splits them by chunk and moves them off this thread)."""
        gone = self.slots.chunk >= 0
        gone[kept] = False
        if gone.any():
            slots = gone.nonzero().squeeze(1)
            self.tiers.put(Evicted(self.slots, slots, *self.backend.gather_kv(slots)))

    def slots_to_keep(self) -> torch.Tensor | None:
        """The slots an eviction now keeps (policy.select_keep over the slots read in arrival
        order; slot indices in that order), or None while the cache is within the budget."""
        limits = self.limits
        if self.kv_tokens <= limits.budget:
            return None
        order = self.slots.arrival_order().numpy()
        chosen = select_keep(self.slots.time.numpy()[order], self.slots.score.numpy()[order],
                             limits)
        return torch.from_numpy(order[chosen.numpy()])

    # ----------------------------------------------------------------------------- positions
    @torch.inference_mode()
    def compact_positions(self) -> int:
        """Give the retained slots gap-free positions; returns how many positions it freed.

        Each slot moves by one shift on all three rows (vision blocks keep their T/H/W layout, see
        `rope.compacted_positions`) and its cached key is re-rotated by that shift; values and the
        linear-attention states hold no positions; tiered chunks move with the slot after them
        (`tier_shift`). A failure leaves the memory as it was."""
        positions, end = self.slots.compacted()
        shift = positions - self.slots.position
        moved = shift.any(0).nonzero()
        if end == self.next_position and moved.numel() == 0:
            return 0
        if moved.numel():
            self.backend.shift_keys(int(moved[0]), shift)
        freed = self.next_position - end
        if self.tiers is not None:
            self.tiers.shift_positions(tier_shift(self.slots.position, shift, -freed))
        self.slots, self.next_position = self.slots.moved(positions), end
        self.compactions += 1
        return freed

    def _make_room(self, span: int, margin: int) -> int:
        """Compact positions if `span` more would pass max_positions - margin; RuntimeError,
        changing nothing, if even compacted it would not fit. Returns the positions freed."""
        if self.next_position + span <= self.max_positions - margin:
            return 0
        if (needed := self.slots.compacted()[1] + span) > self.max_positions:
            raise RuntimeError(f"position {needed} would exceed max_position_embeddings "
                               f"({self.max_positions}) even compacted; reset the memory")
        return self.compact_positions()

    # ----------------------------------------------------------------------------- asking
    @torch.inference_mode()
    def ask(self, question: str, max_new_tokens: int | None = None, *,
            since: float | None = None, until: float | None = None,
            on_token: Callable[[str, int, str], None] | None = None,
            cancelled: Callable[[], bool] | None = None,
            on_recall: Callable[[int, int], None] | None = None) -> Answer:
        """Answer from what the memory holds; the memory is left bit-identical.

        since, until: a stream-time window (seconds, inclusive, None = open): the full-attention
        layers see only the chat prefix and the retained chunks in it, and the evidence comes
        from them (the linear-attention states summarise the whole stream). on_token(answer so
        far, tokens so far, reasoning so far) after each token; cancelled() before each (then
        `cancelled` is set); on_recall(chunks recalled, of them from disk) once, before the
        answer's first token, when the memory has a second tier. With a reasoning block open
        (MemoryConfig.thinking), the answer is what follows `</think>` and the reasoning comes
        apart.
        Validated first, changing nothing (ValueError; no position room: RuntimeError);
        positions are compacted only if the answer would not fit otherwise. A failure while
        answering raises QuestionFailed; after `max_question_s` the answer so far comes back
        with `truncated`."""
        start = time.perf_counter()
        ids = self.layout.question_ids(self.tokenizer, question) if question.strip() else []
        limit = accept_question(question, max_new_tokens, self.config, ids)
        allowed = self._window(since, until)
        self._make_room(len(ids) + limit, margin=0)
        kv_before = self.kv_tokens
        recalled, from_disk = self._recall(ids, allowed, since, until)
        if on_recall is not None and self.tiers is not None:
            on_recall(len(recalled), from_disk)
        slots = self.slots.extend([  # the question's view: recalled slots after the cached ones
            ChunkSlots(p.time_s, p.chunk, p.score, p.position, p.stamp, p.pose)
            for p in recalled])
        if allowed is not None:
            allowed = torch.cat([allowed, torch.ones(len(slots) - len(allowed), dtype=bool)])

        def tokens(generated: list[int]) -> None:
            answer, reasoning = self._texts(generated)
            on_token(answer, len(generated), reasoning)

        keys, values = ((torch.cat([getattr(p, name) for p in recalled], 2) if recalled
                         else None) for name in ("keys", "values"))
        with self.backend.appended_slots(keys, values):
            generated, evidence, stop = self._rolled_back_on_failure(
                lambda snapshot: answer_question(
                    self.backend, slots, ids, self.next_position, limit, self.stop_ids,
                    start + self.config.max_question_s,
                    EvidenceSearch(self.config.evidence_chunks, self.config.evidence_candidates,
                                   lambda: self.backend.restore(snapshot.states)),
                    allowed, on_token and tokens, cancelled),
                QuestionFailed, "the question", restore_after=True)
        answer, reasoning = self._texts(generated)
        return slots.answer(
            answer, evidence, memory_tokens=kv_before,
            latency_ms=(time.perf_counter() - start) * 1e3, generated_tokens=len(generated),
            truncated=stop == "deadline", cancelled=stop == "cancelled", reasoning=reasoning,
            recalled_chunks=len(recalled), recalled_from_disk=from_disk,
            recalled_times=[piece.time_s for piece in recalled])

    def _window(self, since: float | None, until: float | None) -> torch.Tensor | None:
        """The slots a question over [since, until] may see (asking.window_slots); when the
        GPU tier holds none of the window but the second tier does, only the chat prefix."""
        if since is None and until is None:
            return None
        try:
            return window_slots(self.slots, since, until)
        except ValueError:
            times = [] if self.tiers is None else [c.time for c in self.tiers.chunks()]
            if not any((since is None or t >= since) and (until is None or t <= until)
                       for t in times):
                raise
            return self.slots.chunk < 0

    def _recall(self, ids: list[int], allowed: torch.Tensor | None, since: float | None,
                until: float | None) -> tuple[list[TierPiece], int]:
        """The tiered chunks this question calls back, oldest first (asking.recall_chunks),
        and how many of them came from disk."""
        if self.tiers is None or not self.config.recall_tokens:
            return [], 0
        self.tiers.flush(TIER_FLUSH_S)
        index = self.tiers.index()
        visible = None if allowed is None else allowed.nonzero().squeeze(1)
        chunks = recall_chunks(self.backend, index, ids, self.next_position, visible, since,
                               until, self.config.recall_tokens)
        tier = dict(zip(index.chunks, index.tiers))
        return self.tiers.load(chunks), sum(tier[c] == DISK for c in chunks)

    def _texts(self, generated: list[int]) -> tuple[str, str]:
        """(answer, reasoning) of the generated ids: with a reasoning block open, what comes
        before `</think>` is reasoning (all of it while the block is still open)."""
        if self._think_end is None:
            return self._text(generated), ""
        if self._think_end not in generated:
            return "", self._text(generated)
        end = generated.index(self._think_end)
        return self._text(generated[end + 1:]), self._text(generated[:end])

    def _text(self, generated: list[int]) -> str:
        return self.tokenizer.decode(generated, skip_special_tokens=True).strip()

    # ----------------------------------------------------------------------------- rollback
    def _snapshot(self) -> _Snapshot:
        """Everything a chunk or a question may change, at fixed size (the KV cache only by its
        length: it only grows at the end until an eviction, which replaces all layers at once)."""
        start = self.backend.now()
        states = self.backend.snapshot()
        return _Snapshot(states, self.next_position, self.chunks_seen, self.slots, start,
                         self.backend.now())

    def _restore(self, snap: _Snapshot) -> None:
        self.backend.restore(snap.states)
        self.next_position, self.chunks_seen, self.slots = (snap.next_position, snap.chunks_seen,
                                                            snap.slots)

    def _rolled_back_on_failure(self, work: Callable[[_Snapshot], Any],
                                failure_type: type[Exception], what: str,
                                restore_after: bool = False) -> Any:
        """work(snapshot); if it raises, restore the snapshot outside the except block (the
        failed forward's frames dropped, so its tensors can be freed) and raise failure_type.
        restore_after: restore after a success too (a question)."""
        snapshot = self._snapshot()
        try:
            result = work(snapshot)
        except BaseException as error:
            failure = error
            traceback.clear_frames(error.__traceback__)
        else:
            if restore_after:
                self._restore(snapshot)
            return result
        self._restore(snapshot)
        del snapshot
        raise_rolled_back(failure_type, what, failure, self.device)

    # ----------------------------------------------------------------------- state and size
    def export_state(self) -> MemoryState:
        """The stream's whole state, by reference (no copies); see persistence.save_memory."""
        return MemoryState(self.backend.export_tensors() | self.slots.export(),
                           self.next_position, self.chunks_seen, self.compactions,
                           dict(self.slots.stamps), dict(self.slots.poses))

    @torch.inference_mode()
    def import_state(self, state: MemoryState) -> None:
        """Continue the stream `state` describes; see persistence.load_memory.

        Raises ValueError, changing nothing, unless the state fits this model and budget, its
        values are finite and its counters agree (`state_check.check_state`).
        """
        slots = check_state(state, self.export_state().tensors, self.config.budget_tokens,
                            self.max_positions)
        self.backend.import_tensors(state.tensors)
        self.slots, self.next_position = slots, state.next_position
        self.chunks_seen, self.compactions = state.chunks_seen, state.compactions

    @property
    def kv_tokens(self) -> int:
        return self.backend.kv_tokens

    def stats(self) -> MemoryStats:
        """Current size (tokens and bytes) and which chunks are still held."""
        kv_bytes, state_bytes = self.backend.nbytes()
        span_start, span_end = self.slots.span()
        return MemoryStats(
            chunks=self.chunks_seen, kv_tokens=self.kv_tokens, kv_bytes=kv_bytes,
            state_bytes=state_bytes, next_position=self.next_position,
            max_positions=self.max_positions, span_start=span_start, span_end=span_end,
            held=self.slots.held_chunks(self.limits),
            compactions=self.compactions,
            tiered=[] if self.tiers is None else self.tiers.chunks(),
        )

    def close(self) -> None:
        """Stop the second tier's writer (its disk files stay until reset or the next start);
        the memory is not used after this."""
        if self.tiers is not None:
            self.tiers.close()


def tier_shift(positions: torch.Tensor, shift: torch.Tensor, end_shift: int
               ) -> Callable[[int], int]:
    """How a compaction moves a tiered chunk that starts at T position x: as the first retained
    slot after it (so it stays before that slot), by `end_shift` when none is; never below
    position 0. positions, shift: (3, T) the retained slots' positions and their shifts (the
    same on every row)."""
    order = torch.argsort(positions[0], stable=True)
    starts, shifts = positions[0][order], shift[0][order]

    def shift_of(x: int) -> int:
        after = int(torch.searchsorted(starts, x, right=True))
        return max(int(shifts[after]) if after < len(starts) else end_shift, -x)

    return shift_of


def raise_rolled_back(kind: type[RuntimeError], what: str, failure: BaseException,
                      device: torch.device) -> NoReturn:
    """Raise `kind` for a failure the memory was rolled back from; call it outside the except
    block, so the failed forward's tensors are gone (and CUDA's cache can be emptied)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not isinstance(failure, Exception):  # KeyboardInterrupt, SystemExit: not ours to wrap
        raise failure
    raise kind(f"{what} failed and was rolled back: {type(failure).__name__}: {failure}"
               ) from failure
