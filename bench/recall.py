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
as many never shown) is asked of that one memory twice, side by side: with recall switched off
(`<policy>`: the GPU tier alone, the answer as without a second tier) and on
(`<policy>+recall`). `recency+recall` is ReKV's baseline (sinks and the recent window on the
GPU, the same recall at the same budget). 95 % Wilson intervals; paired differences on the same
questions with a bootstrap over streams; recalled chunks per question; the question time with
recall over the time without.

    python -m bench.recall --streams 8 --out bench/results/recall
    python -m bench.recall --hour --streams 4 --objects 3 --seconds 1800 3600 --out DIR
    python -m bench.recall --report a.jsonl b.jsonl --out bench/results/recall

Honest limits: no row can beat `full` on questions `full` gets right; a few streams give wide
intervals. Question times are CPU times of the shipped model unless run elsewhere.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltas_ros.core.loader import LoadedModel, resolve_pixel_budget
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.core.results import Answer
from deltas_ros.training.questions import QA, is_correct

from .answers import FULL, cell
from .busy import busy_questions
from .busy_retention import aggregate, busy_streams, paired_row, position
from .common import add_answers_args, finish, md_table, memory_config, run_answers

RECALL = "+recall"
NO_RECALL = "surprise"  # the default policy without recall: what recall is measured against
HOST_SLACK = 2.0  # host tier over the stream's K/V bytes (the key summaries, the last chunk)


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Bytes of one token's K and V over the full-attention layers: what the host tier keeps."""
    text = loaded.model.config.text_config
    layers = text.layer_types.count("full_attention")
    head_dim = getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    element = torch.empty(0, dtype=loaded.dtype).element_size()
    return 2 * layers * text.num_key_value_heads * head_dim * element


def asked_both_ways(memory: StreamingMemory, qa: QA) -> tuple[Answer, Answer]:
    """(answer without recall, answer with it) from the same memory, one after the other, so
    their times are taken side by side."""
    config = memory.config
    memory.config = replace(config, recall_tokens=0)
    try:
        without = memory.ask(qa.question)
    finally:
        memory.config = config
    return without, memory.ask(qa.question)


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    probe = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    sinks = probe.kv_tokens  # the chat prefix: kept whatever the budget
    per_token = kv_bytes_per_token(loaded)
    with records_path.open("a") as out:
        for seconds, seed, chunks, events, tokens in busy_streams(args, probe):
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
                    answers = [asked_both_ways(memory, qa) for qa in qas]
                    stats = memory.tiers.current_stats()
                    tier = {"recall_tokens": recall, "host_budget_bytes": int(host_mb * 2**20),
                            "tier_host_bytes": stats.host_bytes,
                            "tier_lost": stats.dropped_pieces + stats.dropped_chunks}
                    for qa, (without, with_recall) in zip(qas, answers):
                        out.write(record(stream, events, f"{policy}@{fraction:g}", budget, qa,
                                         without, **tier))
                        out.write(record(stream, events, f"{policy}{RECALL}@{fraction:g}",
                                         budget, qa, with_recall, **tier))
                    memory.tiers.close()
                    log(seconds, seed, f"{policy}{RECALL}@{fraction:g}", started)
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
    names = {r["condition"].split("@")[0].removesuffix(RECALL) for r in records
             if "@" in r["condition"]}
    return sorted(names, key=lambda p: (p != NO_RECALL, p))


def label(condition: str) -> str:
    return {f"recency{RECALL}": f"recency{RECALL} (rekv)"}.get(condition, condition)


def accuracy(records: list[dict]) -> str:
    table = aggregate(records)
    cells = columns(records)
    streams = {s: len({r["seed"] for r in records if r["seconds"] == s}) for s, _ in cells}
    rows = [[FULL] + [cell(table.get(FULL, {}).get(str(s), {}).get("all")) for s, _ in cells]]
    for policy in policies(records):
        for name in (policy, policy + RECALL):
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
    """Per cell, each recall row minus full memory, minus surprise without recall, and the
    default with recall minus rekv: points on the same questions (95 % bootstrap over
    streams)."""
    names = [p + RECALL for p in policies(records)]
    pairs = [(n, FULL) for n in names] + [(n, NO_RECALL) for n in names]
    if NO_RECALL + RECALL in names and f"recency{RECALL}" in names:
        pairs.append((NO_RECALL + RECALL, f"recency{RECALL}"))
    rows = [paired_row(at_budget(records, fraction), pairs, seconds, fraction)
            for seconds, fraction in columns(records)]
    return md_table(["stream", "budget", *(f"{label(a)} - {label(b)}" for a, b in pairs)], rows)


def costs(records: list[dict]) -> str:
    """Per cell and policy: recalled chunks per question, the question time with recall over
    the time without (the same questions of the same memory), the host tier's bytes."""
    by_cell: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        by_cell.setdefault((r["seconds"], r["condition"]), []).append(r)
    rows = []
    for seconds, fraction in columns(records):
        for policy in policies(records):
            with_recall = by_cell.get((seconds, f"{policy}{RECALL}@{fraction:g}"), [])
            without = by_cell.get((seconds, f"{policy}@{fraction:g}"), [])
            if not with_recall or not without:
                continue
            ratio = (sum(r["latency_ms"] for r in with_recall)
                     / max(sum(r["latency_ms"] for r in without), 1e-9))
            host = np.mean([r["tier_host_bytes"] for r in with_recall]) / 2**20
            rows.append([f"{seconds} s", f"{100 * fraction:g} %", label(policy + RECALL),
                         f"{with_recall[0]['recall_tokens']}",
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
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_answers_args(parser)
    args, results, records, _ = run_answers("recall", parser, argv, evaluate)
    results["table"] = aggregate(records)
    world = "hour" if args.hour else "busy"
    title = (f"Recall from the second tier: {Path(results['model']).name}, the {world} world, "
             f"{args.objects} objects" + (" per 5 minutes" if args.hour else " a stream"))
    body = ("\"Did you see ...?\", shown and never shown together, % correct (95 % Wilson "
            "interval, questions). `<policy>`: the GPU tier alone at budget M; "
            "`<policy>+recall`: the same memory with recall from a host tier holding the "
            "whole stream:\n\n" + accuracy(records))
    body += ("\nDifferences in points correct on the same questions (95 % bootstrap interval "
             "over streams):\n\n" + differences(records))
    body += ("\nWhat recall costs, per question (asked both ways of the same memory, one after "
             "the other):\n\n" + costs(records))
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
