"""Retention in the busy world: which policy keeps what a robot is asked about, at 2-25 %?

Why: the method exists for long streams of which only a small fraction can be kept. On the
sparse streams of bench/answers.py (at most three objects) every signal saturates; here many
objects come and go over minutes, so the kept tokens decide the answer.

How: held-out busy streams (scenes.BUSY with --objects objects; seeds below
samples.VALIDATION_SEEDS) of each --seconds length run through `StreamingMemory` chunk by chunk,
once per condition: `full` (no eviction), `state` (sinks + the recent window only) and every
--policies entry at budgets of --fractions of the stream's tokens (the same sinks, window and
buckets for all: only the score differs). After the stream, every condition is asked the same
"Did you see a <colour> <shape>?" questions (bench/busy.py's: every object shown, as many never
shown). A shown object's position is the third of the stream in which it was last in view
(early, middle, late): what a policy must have kept from then. 95 % Wilson intervals.

    python -m bench.busy_retention --streams 8 --out bench/results/busy_retention
    python -m bench.busy_retention --report a.jsonl b.jsonl --out bench/results/busy_retention

Honest limits: the verdict is only as good as the model's full-memory answer (the `full` row);
a policy cannot beat it. A few streams give wide intervals: read them before ranking policies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltas_ros.core.loader import (
    LoadedModel,
    load_model,
    resolve_model_path,
    resolve_pixel_budget,
)
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.training.questions import is_correct
from deltas_ros.training.samples import VALIDATION_SEEDS, sampled_chunks
from deltas_ros.training.scenes import BUSY, SceneStream

from .answers import FULL, STATE, conditions, run_condition, wilson
from .busy import busy_questions
from .common import add_out_arg, finish, md_table, start_results
from .retention import PIXEL_DIFF

POSITIONS = ("early", "middle", "late")
NEVER = "never shown"


def position(events: list[dict], question: str, seconds: float) -> str:
    """Where in the stream the object a "did you see" question names was last in view."""
    shown = [e for e in events if e.get("kind") == "object"
             and f"{e['colour']} {e['shape']}" in question]
    if not shown:
        return NEVER
    last = max(e["time"] for e in shown)
    return POSITIONS[min(int(3 * last / seconds), 2)]


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    probe = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    sinks = probe.kv_tokens  # the chat prefix: kept whatever the budget
    options = replace(BUSY, objects=(args.objects, args.objects))
    with records_path.open("a") as out:
        for seconds in args.seconds:
            for seed in range(args.first_seed, args.first_seed + args.streams):
                if seed >= VALIDATION_SEEDS:
                    raise ValueError("evaluation seeds must stay below the validation seeds")
                scene = SceneStream(seconds, args.width, args.height, seed, options)
                chunks = sampled_chunks(scene)
                events = scene.events()
                qas = [qa for kind, qa in busy_questions(events, seed) if kind.startswith("seen")]
                tokens = sinks + sum(probe.builder.build(f, t, 0).num_tokens for f, t in chunks)
                for name, budget, policy in conditions(args, tokens, sinks):
                    started = time.perf_counter()
                    config = MemoryConfig(
                        budget_tokens=budget, sink_tokens=sinks, window_tokens=args.window,
                        policy="deltas" if policy == PIXEL_DIFF else policy, seed=seed,
                        pixel_budget=pixel_budget, max_new_tokens=args.max_new_tokens,
                        evidence_candidates=0)
                    answers = run_condition(loaded, chunks, qas, config, policy == PIXEL_DIFF)
                    for qa, text, _ in answers:
                        out.write(json.dumps({
                            "seconds": seconds, "seed": seed, "condition": name,
                            "budget": budget, "tokens": tokens, "question": qa.question,
                            "truth": qa.answer, "answer": text, "correct": is_correct(qa, text),
                            "position": position(events, qa.question, seconds)}) + "\n")
                    out.flush()
                    print(f"{seconds:4d} s seed {seed} {name:22s} "
                          f"{sum(is_correct(q, t) for q, t, _ in answers)}/{len(answers)} "
                          f"({time.perf_counter() - started:.1f} s)", flush=True)


def aggregate(records: list[dict]) -> dict[str, dict[str, dict[str, list[int]]]]:
    """{condition: {seconds: {"all" | position | NEVER: [hits, n]}}}"""
    table: dict[str, dict[str, dict[str, list[int]]]] = {}
    for r in records:
        cell = table.setdefault(r["condition"], {}).setdefault(str(r["seconds"]), {})
        for key in ("all", r["position"]):
            hits = cell.setdefault(key, [0, 0])
            hits[0] += bool(r["correct"])
            hits[1] += 1
    return table


def cell(hits: list[int] | None) -> str:
    if not hits or not hits[1]:
        return "-"
    lo, hi = wilson(*hits)
    return f"{100 * hits[0] / hits[1]:.0f} ({100 * lo:.0f}-{100 * hi:.0f})"


def order(table: dict[str, Any]) -> list[str]:
    """full, state, then the budgets from the tightest, policies by name."""
    rest = sorted((c for c in table if c not in (FULL, STATE)),
                  key=lambda c: (float(c.split("@")[1]), c))
    return [c for c in (FULL, STATE) if c in table] + rest


def report(table: dict[str, Any], records: list[dict]) -> str:
    lengths = sorted({r["seconds"] for r in records})
    streams = {s: len({r["seed"] for r in records if r["seconds"] == s}) for s in lengths}
    headers = ["condition"] + [f"{s:g} s ({streams[s]} streams)" for s in lengths]
    rows = [[c] + [cell(table[c].get(str(s), {}).get("all")) for s in lengths]
            for c in order(table)]
    text = ("\"Did you see ...?\", shown and never shown together, % correct (95 % Wilson "
            "interval):\n\n" + md_table(headers, rows))
    for s in lengths:
        kinds = [*POSITIONS, NEVER]
        rows = [[c] + [cell(table[c].get(str(s), {}).get(k)) for k in kinds]
                for c in order(table)]
        text += (f"\n{s:g} s streams: shown objects by where they were last in view, and "
                 "never-shown ones, % correct:\n\n" + md_table(["condition", *kinds], rows))
    return text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the shipped scene model)")
    parser.add_argument("--streams", type=int, default=8, help="streams per length")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--objects", type=int, default=8, help="objects per stream")
    parser.add_argument("--seconds", type=int, nargs="+", default=[120, 300, 600])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.25],
                        help="budgets as fractions of the stream's tokens")
    parser.add_argument("--window", type=int, default=14, help="recent window (tokens)")
    parser.add_argument("--policies", nargs="+", default=[*POLICY_NAMES, PIXEL_DIFF],
                        choices=[*POLICY_NAMES, PIXEL_DIFF])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--pixel-budget", type=int, help="default: the model's stored one")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--records", type=Path, help="answers file (JSON lines) to append to")
    parser.add_argument("--report", type=Path, nargs="+",
                        help="only report these answers files (merged)")
    add_out_arg(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = start_results("busy_retention", argv)
    model_path = resolve_model_path(args.model)
    files = args.report or [args.records or args.out / "busy_retention.jsonl"]
    if not args.report:
        files[0].parent.mkdir(parents=True, exist_ok=True)
        evaluate(args, load_model(model_path, "cpu"), files[0])
    records = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    table = aggregate(records)
    results |= {"model": str(model_path), "answers_files": [str(f) for f in files],
                "table": table}
    title = f"Retention in the busy world: {model_path.name}, {args.objects} objects a stream"
    return finish(args.out, results, title, report(table, records))


if __name__ == "__main__":
    main()
