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

from deltas_ros.core.loader import (
    LoadedModel,
    resolve_pixel_budget,
)
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.training.questions import is_correct
from deltas_ros.training.samples import VALIDATION_SEEDS, sampled_chunks
from deltas_ros.training.scenes import BUSY, SceneStream

from .answers import FULL, STATE, cell, conditions, run_condition
from .busy import busy_questions
from .common import add_answers_args, finish, md_table, run_answers
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


def plot(table: dict[str, Any], out: Path) -> Path:
    """% correct against the budget, a panel per stream length, a line per policy; full
    memory and state only as horizontal lines (they do not depend on the budget)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({int(s) for per in table.values() for s in per})
    policies = sorted({c.split("@")[0] for c in table if "@" in c})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), 4.5), sharey=True,
                             squeeze=False)
    for ax, seconds in zip(axes[0], lengths):
        for name, style in ((FULL, "k-"), (STATE, "k:")):
            hits = table.get(name, {}).get(str(seconds), {}).get("all")
            if hits:
                ax.axhline(100 * hits[0] / hits[1], color="k", linestyle=style[1:], label=name)
        for i, policy in enumerate(policies):
            cells = sorted((float(c.split("@")[1]), table[c][str(seconds)]["all"])
                           for c in table if c.split("@")[0] == policy
                           and str(seconds) in table[c])
            if cells:
                ax.plot([100 * f for f, _ in cells], [100 * h / n for _, (h, n) in cells],
                        marker="os^vD"[i % 5], color=plt.cm.tab20(i % 20),
                        linewidth=2.5 if policy.startswith("deltas") else 1.2, label=policy)
        budgets = sorted({100 * float(c.split("@")[1]) for c in table if "@" in c})
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.set_title(f"{seconds} s streams")
        ax.set_xlabel("budget (% of the stream's tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel('"Did you see ...?" % correct')
    axes[0][-1].legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "busy_retention.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="streams per length")
    parser.add_argument("--objects", type=int, default=8, help="objects per stream")
    parser.add_argument("--seconds", type=int, nargs="+", default=[120, 300, 600])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.25],
                        help="budgets as fractions of the stream's tokens")
    parser.add_argument("--window", type=int, default=14, help="recent window (tokens)")
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES),
                        choices=[*POLICY_NAMES, PIXEL_DIFF])
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="long enough for a busy answer naming every object of a shape")
    add_answers_args(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    results, records, _ = run_answers("busy_retention", args, argv, evaluate)
    table = aggregate(records)
    results["table"] = table
    title = (f"Retention in the busy world: {Path(results['model']).name}, {args.objects} "
             "objects a stream")
    body = report(table, records)
    body += f"\n![retention per policy]({plot(table, args.out).name})\n"
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
