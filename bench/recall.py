"""Recall from the second tier: does calling evicted chunks back answer as full memory does?

Why: at 1-2 % of a long stream's tokens on the GPU, a policy must drop most of what a robot is
later asked about. The second tier keeps what eviction lets go in host memory, and a question
calls back the chunks its queries score highest (at most recall_tokens). This measures whether
that recovers full memory's answers, and how much the GPU tier's policy still matters with it.

How: the held-out busy streams of bench/busy_retention.py (--objects objects, seeds below the
validation seeds; --hour: the hour world, --objects of its own per 5-minute part) run through
`StreamingMemory` once with no eviction (`full`) and, per --fractions budget M of the stream's
tokens, once per --policies entry with a host tier large enough for the whole stream and
recall_tokens = --recall-tokens (default M). Every "did you see" question (every object shown,
as many never shown) is asked of that one memory several times, side by side: with recall
switched off (`<policy>`: the GPU tier alone, the answer as without a second tier), then with
recall scoring the tiered chunks by each --summary kind of key summary (`<policy>+recall:<kind>`,
recall.SUMMARY_KINDS; the memory's tiered chunks are re-summarized per kind) with the queries of
the question's first full-attention layer (as the memory recalls), and with --queries
every-layer also by every full-attention layer's queries from a prefill over the GPU tier
(`<kind>/every-layer`), then with the
`oracle`'s chunks: those where the asked object was in view, within the same recall tokens
(what a perfect score could recall; nothing for a never-shown object). `recency+recall:mean` is
ReKV's baseline (sinks and the recent window on the GPU, the mean key, the same budget). 95 %
Wilson intervals; paired differences on the same questions with a bootstrap over streams; how
many recalled chunks had the asked object in view, and whether the questions missed without
recall had it in a GPU-held or a tiered chunk; recalled chunks per question; the question time
with recall over the time without.

    python -m bench.recall --streams 8 --summary mean top-norm all-keys --out bench/results/recall
    python -m bench.recall --streams 8 --summary top-norm --queries first every-layer --out DIR
    python -m bench.recall --hour --streams 4 --objects 3 --seconds 1800 3600 --out DIR
    (the same with --resume after a stop: bench.common.streams_done)
    python -m bench.recall --report a.jsonl b.jsonl --out bench/results/recall

Honest limits: no row can beat `full` on questions `full` gets right; a few streams give wide
intervals. Question times are CPU times of the shipped model unless run elsewhere.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from deltas_ros.core import memory as memory_module
from deltas_ros.core.asking import recall_chunks
from deltas_ros.core.loader import LoadedModel, resolve_pixel_budget
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.core.recall import SUMMARY_KINDS, choose_recall, summarizer
from deltas_ros.core.results import Answer
from deltas_ros.core.tiers import TierIndex, TierStore
from deltas_ros.training.questions import QA, identities_of, is_correct

from .answers import FULL, cell
from .busy import busy_questions
from .busy_misses import in_view
from .busy_retention import NEVER, aggregate, busy_streams, paired_row, position
from .common import (
    add_answers_args,
    add_resume_arg,
    finish,
    md_table,
    memory_config,
    run_answers,
    stream_done,
    streams_done,
)

RECALL = "+recall"
NO_RECALL = "surprise"  # the default policy without recall: what recall is measured against
ORACLE = "oracle"  # recall of the chunks where the asked object was in view: a perfect score
EVERY_LAYER = "every-layer"  # queries from every full-attention layer (--queries)
QUERIES = ("first", EVERY_LAYER)
HOST_SLACK = 2.0  # host tier over the stream's K/V bytes (the key summaries, the last chunk)


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Bytes of one token's K and V over the full-attention layers: what the host tier keeps."""
    text = loaded.model.config.text_config
    layers = text.layer_types.count("full_attention")
    head_dim = getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    element = torch.empty(0, dtype=loaded.dtype).element_size()
    return 2 * layers * text.num_key_value_heads * head_dim * element


def restocked(store: TierStore, kind: str, every_layer: bool) -> TierStore:
    """A host tier holding `store`'s chunks, summarized by `kind` (recall.summarizer) at the
    first full-attention layer or at every one."""
    index = store.index()
    other = TierStore(host_bytes=store.host_bytes, pending=len(index.chunks) + 1)
    other.summarize = summarizer(kind, int(index.tokens.max()) if index.chunks else 1,
                                 every_layer)
    for piece in store.load(index.chunks):
        other.put(piece)
    other.flush(timeout=600.0)
    return other


def asked_object(events: list[dict], question: str) -> tuple[str, str] | None:
    """(colour, shape) of the shown object a "did you see" question names; None if never
    shown."""
    for shown in identities_of(events):
        if f"{shown['colour']} {shown['shape']}" in question:
            return shown["colour"], shown["shape"]
    return None


def with_object(events: list[dict], asked: tuple[str, str] | None, times: list[float]) -> int:
    """How many chunks at these stream times had the asked object in view."""
    if asked is None or not times:
        return 0
    return int(in_view(events, *asked, np.asarray(times, dtype=float)).sum())


@contextmanager
def oracle_recall(events: list[dict], asked: tuple[str, str] | None) -> Iterator[None]:
    """Within this block a memory's questions recall the tiered chunks where the asked object
    was in view, those nearest the middle of its time in view first, within the same
    recall_tokens (nothing for an object never shown)."""
    spans = [(e["time"] + e["end"]) / 2 for e in events if e.get("kind") == "object"
             and asked == (e["colour"], e["shape"])]

    def chosen(backend, index: TierIndex, ids, position, visible, since, until,
               budget: int) -> list[int]:
        times = index.times.numpy()
        mask = in_view(events, *asked, times) if asked else np.zeros(len(times), bool)
        picked = np.flatnonzero(mask)
        near = torch.tensor([-min(abs(times[i] - mid) for mid in spans) for i in picked])
        return [index.chunks[int(picked[i])]
                for i in choose_recall(near, index.tokens[picked], budget)]

    with mock.patch.object(memory_module, "recall_chunks", chosen):
        yield


def kind_names(kinds: list[str], queries: list[str]) -> dict[str, tuple[str, str]]:
    """{condition's kind: (summary kind, queries)}: `kind` with the first layer's queries,
    `kind/every-layer` with every layer's."""
    return {(kind if source == "first" else f"{kind}/{source}"): (kind, source)
            for kind in kinds for source in queries}


def asked_every_way(memory: StreamingMemory, stores: dict[str, TierStore], events: list[dict],
                    qa: QA) -> dict[str, Answer]:
    """{"": the answer without recall, name: with recall from the store of that name
    (`kind_names`: its summaries, scored by its queries), ORACLE: with the oracle's chunks},
    asked of the same memory one after the other, so that their times are taken side by
    side."""
    config, tiers = memory.config, memory.tiers
    memory.config = replace(config, recall_tokens=0)
    try:
        answers = {"": memory.ask(qa.question)}
    finally:
        memory.config = config
    try:
        for name, store in stores.items():
            memory.tiers = store
            with mock.patch.object(memory_module, "recall_chunks", partial(
                    recall_chunks, every_layer=name.endswith(EVERY_LAYER))):
                answers[name] = memory.ask(qa.question)
        memory.tiers = tiers
        with oracle_recall(events, asked_object(events, qa.question)):
            answers[ORACLE] = memory.ask(qa.question)
    finally:
        memory.tiers = tiers
    return answers


def held_times(memory: StreamingMemory) -> list[float]:
    """Stream times of the chunks the GPU tier holds (any of their tokens)."""
    chunks = memory.slots.chunk
    return [memory.slots.chunk_time(c) for c in chunks[chunks >= 0].unique().tolist()]


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    probe = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    sinks = probe.kv_tokens  # the chat prefix: kept whatever the budget
    per_token = kv_bytes_per_token(loaded)
    done = streams_done(records_path, args.resume)
    with records_path.open("a") as out:
        for seconds, seed, chunks, events, tokens in busy_streams(args, probe, skip=done):
            qas = [qa for kind, qa in busy_questions(events, seed, args.hour)
                   if kind.startswith("seen")]
            host_mb = HOST_SLACK * tokens * per_token / 2**20 + 1
            stream = {"seconds": seconds, "seed": seed, "tokens": tokens}

            started = time.perf_counter()
            full = StreamingMemory(loaded, memory_config(
                args, budget_tokens=10**8, pixel_budget=pixel_budget,
                max_new_tokens=args.max_new_tokens, evidence_candidates=0))
            for frames, times in chunks:
                full.add_chunk(frames, times)
            for qa in qas:
                out.write(record(stream, events, FULL, 10**8, qa, full.ask(qa.question)))
            log(seconds, seed, FULL, started)
            del full
            for fraction in args.fractions:
                budget = max(round(fraction * tokens), sinks + args.window + 1)
                recall = args.recall_tokens or budget
                for policy in args.policies:
                    started = time.perf_counter()
                    memory = StreamingMemory(loaded, memory_config(
                        args, budget_tokens=budget, sink_tokens=sinks, seed=seed, policy=policy,
                        pixel_budget=pixel_budget, max_new_tokens=args.max_new_tokens,
                        evidence_candidates=0, host_budget_mb=host_mb, recall_tokens=recall))
                    for frames, times in chunks:
                        memory.add_chunk(frames, times)
                    memory.tiers.flush(timeout=600.0)
                    stores = {name: restocked(memory.tiers, kind, source == EVERY_LAYER)
                              for name, (kind, source)
                              in kind_names(args.summary, args.queries).items()}
                    stats = memory.tiers.current_stats()
                    tier = {"recall_tokens": recall, "host_budget_bytes": int(host_mb * 2**20),
                            "tier_host_bytes": stats.host_bytes,
                            "tier_lost": stats.dropped_pieces + stats.dropped_chunks}
                    held, tiered = held_times(memory), memory.tiers.index().times.tolist()
                    for qa in qas:
                        asked = asked_object(events, qa.question)
                        where = {"object_chunks_held": with_object(events, asked, held),
                                 "object_chunks_tiered": with_object(events, asked, tiered)}
                        for kind, answer in asked_every_way(memory, stores, events, qa).items():
                            name = f"{policy}{RECALL}:{kind}" if kind else policy
                            out.write(record(
                                stream, events, f"{name}@{fraction:g}", budget, qa, answer,
                                recalled_with_object=with_object(
                                    events, asked, answer.recalled_times), **where, **tier))
                    for store in stores.values():
                        store.close()
                    memory.tiers.close()
                    log(seconds, seed, f"{policy}{RECALL}@{fraction:g}", started)
            out.write(stream_done(seconds, seed))
            out.flush()


def record(stream: dict[str, Any], events: list[dict], condition: str, budget: int, qa: QA,
           answer: Answer, **more: Any) -> str:
    """One answer's JSON line: the stream's fields (seconds, seed, tokens), the question, the
    answer, its score and what recall did."""
    return json.dumps(stream | {
        "condition": condition, "budget": budget, "question": qa.question, "truth": qa.answer,
        "answer": answer.text, "correct": is_correct(qa, answer.text),
        "position": position(events, qa.question, stream["seconds"]),
        "latency_ms": answer.latency_ms, "recalled_chunks": answer.recalled_chunks,
        "recalled_from_disk": answer.recalled_from_disk, **more}) + "\n"


def log(seconds: int, seed: int, condition: str, started: float) -> None:
    print(f"{seconds:5d} s seed {seed} {condition:24s} ({time.perf_counter() - started:.1f} s)",
          flush=True)


def columns(records: list[dict]) -> list[tuple[int, float]]:
    """(seconds, budget fraction) of every cell, shortest stream and tightest budget first."""
    fractions = {float(r["condition"].split("@")[1]) for r in records if "@" in r["condition"]}
    return [(s, f) for s in sorted({r["seconds"] for r in records}) for f in sorted(fractions)]


def policies(records: list[dict]) -> list[str]:
    """The policies asked, the default first."""
    names = {r["condition"].split("@")[0].split(RECALL)[0] for r in records
             if "@" in r["condition"]}
    return sorted(names, key=lambda p: (p != NO_RECALL, p))


def kinds(records: list[dict]) -> list[str]:
    """The summary kinds recalled with, in SUMMARY_KINDS order (each by the first layer's
    queries, then every layer's), the oracle last."""
    names = {r["condition"].split("@")[0].split(":")[1] for r in records
             if RECALL + ":" in r["condition"]}
    return [k for k in (*kind_names(list(SUMMARY_KINDS), list(QUERIES)), ORACLE) if k in names]


def recalled(policy: str, kind: str) -> str:
    return f"{policy}{RECALL}:{kind}"


def label(condition: str) -> str:
    """ReKV's baseline is recency with recall by the mean key."""
    return condition + (" (rekv)" if condition == recalled("recency", "mean") else "")


def rows_of(records: list[dict]) -> list[str]:
    """Every condition but full memory: per policy, without recall then with each kind."""
    return [name for policy in policies(records)
            for name in (policy, *(recalled(policy, k) for k in kinds(records)))]


def accuracy(records: list[dict], shown_only: bool = False) -> str:
    """% correct per condition and cell (`shown_only`: the questions about shown objects)."""
    if shown_only:
        records = [r for r in records if r["position"] != NEVER]
    table = aggregate(records)
    cells = columns(records)
    streams = {s: len({r["seed"] for r in records if r["seconds"] == s}) for s, _ in cells}
    rows = [[FULL] + [cell(table.get(FULL, {}).get(str(s), {}).get("all")) for s, _ in cells]]
    for name in rows_of(records):
        rows.append([label(name)] + [cell(table.get(f"{name}@{f:g}", {})
                                          .get(str(s), {}).get("all")) for s, f in cells])
    headers = ["condition"] + [f"{s} s at {100 * f:g} % ({streams[s]} streams)"
                               for s, f in cells]
    return md_table(headers, rows)


def at_budget(records: list[dict], fraction: float) -> list[dict]:
    """The records with full memory's named as a condition at `fraction` (for `paired`)."""
    return [r | {"condition": f"{FULL}@{fraction:g}"} if r["condition"] == FULL else r
            for r in records]


def differences(records: list[dict]) -> str:
    """Per cell and recall row: minus full memory, minus the same memory without recall, and
    (the default policy) minus ReKV recalling with the same kind: points on the same questions
    (95 % bootstrap over streams)."""
    rows = []
    for seconds, fraction in columns(records):
        paired_records = at_budget(records, fraction)
        for policy in policies(records):
            for kind in kinds(records):
                name = recalled(policy, kind)
                against = [FULL, policy]
                if policy == NO_RECALL and "recency" in policies(records):
                    against.append(recalled("recency", kind))
                row = paired_row(paired_records, [(name, a) for a in against], seconds,
                                 fraction)
                rows.append([*row[:2], label(name), *row[2:], *["-"] * (3 - len(against))])
    return md_table(["stream", "budget", "condition", "- full", "- without recall",
                     "- recency+recall (same kind)"], rows)


def aim(records: list[dict]) -> str:
    """Per cell and recall row, over the questions about shown objects: the share of recalled
    chunks that had the asked object in view, and the share of questions with at least one;
    then, of the questions missed without recall, how many had the object in a GPU-held chunk
    and in a tiered one."""
    rows = []
    shown = [r for r in records if r["position"] != NEVER and "recalled_with_object" in r]
    for seconds, fraction in columns(records):
        for policy in policies(records):
            missed = [r for r in shown if r["seconds"] == seconds and not r["correct"]
                      and r["condition"] == f"{policy}@{fraction:g}"]
            for kind in kinds(records):
                mine = [r for r in shown if r["seconds"] == seconds
                        and r["condition"] == f"{recalled(policy, kind)}@{fraction:g}"]
                if not mine:
                    continue
                share = (sum(r["recalled_with_object"] for r in mine)
                         / max(sum(r["recalled_chunks"] for r in mine), 1))
                rows.append([f"{seconds} s", f"{100 * fraction:g} %",
                             label(recalled(policy, kind)), len(mine), f"{share:.2f}",
                             f"{np.mean([r['recalled_with_object'] > 0 for r in mine]):.2f}",
                             len(missed), sum(r["object_chunks_held"] > 0 for r in missed),
                             sum(r["object_chunks_tiered"] > 0 for r in missed)])
    return md_table(["stream", "budget", "condition", "shown-object questions",
                     "recalled chunks with the object", "questions recalling it",
                     "missed without recall", "of them held on the GPU", "of them tiered"],
                    rows)


def costs(records: list[dict]) -> str:
    """Per cell and recall row: recalled chunks per question, the question time with recall
    over the time without (the same questions of the same memory), the host tier's bytes."""
    by_cell: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        by_cell.setdefault((r["seconds"], r["condition"]), []).append(r)
    rows = []
    for seconds, fraction in columns(records):
        for policy in policies(records):
            without = by_cell.get((seconds, f"{policy}@{fraction:g}"), [])
            for kind in kinds(records):
                with_recall = by_cell.get((seconds, f"{recalled(policy, kind)}@{fraction:g}"),
                                          [])
                if not with_recall or not without:
                    continue
                ratio = (sum(r["latency_ms"] for r in with_recall)
                         / max(sum(r["latency_ms"] for r in without), 1e-9))
                host = np.mean([r["tier_host_bytes"] for r in with_recall]) / 2**20
                rows.append([f"{seconds} s", f"{100 * fraction:g} %",
                             label(recalled(policy, kind)), f"{with_recall[0]['recall_tokens']}",
                             f"{np.mean([r['recalled_chunks'] for r in with_recall]):.1f}",
                             f"{np.median([r['latency_ms'] for r in without]):.0f}",
                             f"{np.median([r['latency_ms'] for r in with_recall]):.0f}",
                             f"{ratio:.2f}", f"{host:.2f}",
                             f"{sum(r['tier_lost'] for r in with_recall)}"])
    return md_table(["stream", "budget", "condition", "recall tokens",
                     "recalled chunks / question", "question ms without (median)",
                     "with (median)", "time with / without (sums)", "host tier MiB (mean)",
                     "lost to the tier"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="streams per length")
    parser.add_argument("--objects", type=int, default=8,
                        help="objects per stream (--hour: per 5-minute part)")
    parser.add_argument("--seconds", type=int, nargs="+", default=[120, 300, 600])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.01],
                        help="GPU budgets M as fractions of the stream's tokens")
    parser.add_argument("--window", type=int, default=14, help="recent window (tokens)")
    parser.add_argument("--policies", nargs="+", default=[NO_RECALL, "recency"],
                        choices=POLICY_NAMES)
    parser.add_argument("--recall-tokens", type=int, default=0,
                        help="tokens a question calls back (default 0: the budget M)")
    parser.add_argument("--hour", action="store_true",
                        help="the hour world: --objects objects of its own per 5-minute part")
    parser.add_argument("--summary", nargs="+", default=["mean"], choices=SUMMARY_KINDS,
                        help="key summaries to recall with, each over the same memory")
    parser.add_argument("--queries", nargs="+", default=["first"], choices=QUERIES,
                        help="the question's queries that score: its first full-attention "
                        "layer's (as the memory recalls) and/or every layer's")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_resume_arg(parser)
    add_answers_args(parser)
    args, results, records, _ = run_answers("recall", parser, argv, evaluate)
    results["table"] = aggregate(records)
    world = "hour" if args.hour else "busy"
    title = (f"Recall from the second tier: {Path(results['model']).name}, the {world} world, "
             f"{args.objects} objects" + (" per 5 minutes" if args.hour else " a stream"))
    body = ("\"Did you see ...?\", shown and never shown together, % correct (95 % Wilson "
            "interval, questions). `<policy>`: the GPU tier alone at budget M; "
            "`<policy>+recall:<kind>`: the same memory with recall from a host tier holding the "
            "whole stream, chunks scored by their `<kind>` key summary (`/every-layer`: "
            "by every full-attention layer's queries, else the first's; `oracle`: the chunks "
            "where the asked object was in view, within the same recall tokens):\n\n"
            + accuracy(records))
    body += ("\nThe questions about shown objects alone:\n\n" + accuracy(records, True))
    body += ("\nDifferences in points correct on the same questions (95 % bootstrap interval "
             "over streams):\n\n" + differences(records))
    body += ("\nWhere recall looks, over the questions about shown objects:\n\n"
             + aim(records))
    body += ("\nWhat recall costs, per question (asked every way of the same memory, one after "
             "the other):\n\n" + costs(records))
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
