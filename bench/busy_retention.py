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
import math
import time
from collections.abc import Collection, Iterator
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
from deltas_ros.training.scenes import BUSY, HOUR, SceneStream

from .answers import FULL, STATE, cell, conditions, run_condition, wilson
from .busy import busy_questions
from .common import add_answers_args, finish, md_table, memory_config, run_answers
from .retention import PIXEL_DIFF, engine_policy

POSITIONS = ("early", "middle", "late")
NEVER = "never shown"
STATE_BASED = ("deltas", "surprise", "deltas_surprise")
CONTROLS = ("recency", "uniform", "random")
# Per token against per chunk, on the same questions: (policy, against).
PAIRS = (("surprise", "deltas"), ("deltas_surprise", "deltas"), ("beta_error", "deltas"),
         ("key_norm", "deltas"))
BOOTSTRAP = 2000


def position(events: list[dict], question: str, seconds: float) -> str:
    """Where in the stream the object a "did you see" question names was last in view."""
    shown = [e for e in events if e.get("kind") == "object"
             and f"{e['colour']} {e['shape']}" in question]
    if not shown:
        return NEVER
    last = max(e["time"] for e in shown)
    return POSITIONS[min(int(3 * last / seconds), 2)]


def busy_streams(args: argparse.Namespace, probe: StreamingMemory,
                 skip: Collection[tuple[int, int]] = (),
                 ) -> Iterator[tuple[int, int, list, list[dict], int]]:
    """(seconds, seed, chunks, events, tokens with the chat prefix) per held-out busy stream of
    --objects objects (--hour, where a benchmark has it: the hour world's, per 5-minute part),
    for each --seconds length and --streams seeds from --first-seed, but the (seconds, seed)
    in `skip` (a resumed run's finished streams: never rendered)."""
    for seconds in args.seconds:
        for seed in range(args.first_seed, args.first_seed + args.streams):
            if (seconds, seed) in skip:
                continue
            scene = held_out_scene(args, seconds, seed)
            chunks = sampled_chunks(scene)
            tokens = probe.kv_tokens + sum(chunk_tokens(probe, chunks))
            yield seconds, seed, chunks, scene.events(), tokens


def held_out_scene(args: argparse.Namespace, seconds: int, seed: int) -> SceneStream:
    """The held-out busy stream of this length and seed: --objects objects (--hour, where a
    benchmark has it: the hour world's, per 5-minute part) in --width x --height frames."""
    if seed >= VALIDATION_SEEDS:
        raise ValueError("evaluation seeds must stay below the validation seeds")
    world = HOUR if getattr(args, "hour", False) else BUSY
    options = replace(world, objects=(args.objects, args.objects))
    return SceneStream(seconds, args.width, args.height, seed, options)


def chunk_tokens(probe: StreamingMemory, chunks: list) -> list[int]:
    """The tokens each chunk brings into a memory of probe's model and pixel budget."""
    return [probe.builder.build(f, t, 0).num_tokens for f, t in chunks]


def probe_memory(args: argparse.Namespace, loaded: LoadedModel,
                 ) -> tuple[int, StreamingMemory, int]:
    """(the resolved pixel budget, a memory of it that counts chunk tokens, the sinks: its
    chat prefix, kept whatever the budget)."""
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    probe = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    return pixel_budget, probe, probe.kv_tokens


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget, probe, sinks = probe_memory(args, loaded)
    with records_path.open("a") as out:
        for seconds, seed, chunks, events, tokens in busy_streams(args, probe):
            qas = [qa for kind, qa in busy_questions(events, seed) if kind.startswith("seen")]
            for name, budget, policy in conditions(args, tokens, sinks):
                started = time.perf_counter()
                config = memory_config(
                    args, budget_tokens=budget, sink_tokens=sinks, seed=seed,
                    policy=engine_policy(policy), pixel_budget=pixel_budget,
                    max_new_tokens=args.max_new_tokens, evidence_candidates=0)
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


def share(hits: list[int]) -> float:
    return hits[0] / hits[1]


def summary(table: dict[str, Any]) -> str:
    """The main table folded for a README: a row per policy, a column per budget, each cell
    the stream lengths' shares in order; policies by their mean share over the budgets under
    25 % (the paper's regime), best first."""
    lengths = sorted({int(s) for per in table.values() for s in per})
    budgets = sorted({float(c.split("@")[1]) for c in table if "@" in c})
    policies = sorted({c.split("@")[0] for c in table if "@" in c})

    def shares(condition: str) -> list[float]:
        per = table.get(condition, {})
        return [100 * share(per[str(s)]["all"]) if str(s) in per else math.nan
                for s in lengths]

    def line(values: list[float]) -> str:
        return " · ".join("-" if math.isnan(v) else f"{v:.0f}" for v in values)

    def regime(policy: str) -> float:
        values = [v for f in budgets if f < 0.25 for v in shares(f"{policy}@{f:g}")]
        return sum(values) / len(values) if values else 0.0

    rows = [[name, line(shares(name))] + [""] * (len(budgets) - 1)
            for name in (FULL, STATE) if name in table]
    rows += [[policy] + [line(shares(f"{policy}@{f:g}")) for f in budgets]
             for policy in sorted(policies, key=lambda p: (-regime(p), p))]
    return md_table(["policy"] + [f"{100 * f:g} %" for f in budgets], rows)


def verdicts(table: dict[str, Any]) -> str:
    """Per length and budget, read from the intervals as the targets are worded: the best
    policies (ties named together); the state-based ones whose share lies inside the best's
    95 % interval; whether DeltaS is ahead of every control by more than the intervals (its
    lower bound above their upper bounds)."""
    lengths = sorted({int(s) for per in table.values() for s in per})
    budgets = sorted({float(c.split("@")[1]) for c in table if "@" in c})
    rows = []
    for seconds in lengths:
        for fraction in budgets:
            cells = {c.split("@")[0]: table[c][str(seconds)]["all"] for c in table
                     if c.endswith(f"@{fraction:g}") and str(seconds) in table[c]}
            if not cells:
                continue
            top = max(share(hits) for hits in cells.values())
            best = sorted(p for p in cells if share(cells[p]) == top)
            low, high = wilson(*cells[best[0]])
            level = [p for p in STATE_BASED if p in cells and low <= share(cells[p]) <= high]
            named = ", ".join(best[:3]) + (f" +{len(best) - 3}" if len(best) > 3 else "")
            ahead = "-"
            if "deltas" in cells and all(c in cells for c in CONTROLS):
                floor = wilson(*cells["deltas"])[0]
                ahead = "yes" if all(floor > wilson(*cells[c])[1] for c in CONTROLS) else "no"
            rows.append([f"{seconds} s", f"{100 * fraction:g} %",
                         f"{100 * top:.0f}: {named}", ", ".join(level) or "none",
                         ahead])
    return md_table(["stream", "budget", "best", "state-based within the best's interval",
                     "DeltaS ahead of recency, uniform, random"], rows)


def paired(records: list[dict], policy: str, against: str, seconds: int, fraction: float,
           seed: int = 0) -> tuple[float, float, float] | None:
    """policy's share correct minus against's, in points, on the same questions, with a 95 %
    bootstrap interval over streams (the questions of a stream are not independent)."""
    import numpy as np

    by_stream: dict[int, list[list[int]]] = {}
    wanted = {f"{policy}@{fraction:g}": 0, f"{against}@{fraction:g}": 1}
    for r in records:
        if r["seconds"] == seconds and r["condition"] in wanted:
            hits = by_stream.setdefault(r["seed"], [[0, 0], [0, 0]])[wanted[r["condition"]]]
            hits[0] += bool(r["correct"])
            hits[1] += 1
    if not by_stream or any(n == 0 for pair in by_stream.values() for _, n in pair):
        return None
    counts = np.array([[a[0], b[0], a[1]] for a, b in by_stream.values()], dtype=float)
    diff = 100 * (counts[:, 0].sum() - counts[:, 1].sum()) / counts[:, 2].sum()
    draws = np.random.default_rng(seed).integers(0, len(counts), (BOOTSTRAP, len(counts)))
    sums = counts[draws].sum(axis=1)
    spread = 100 * (sums[:, 0] - sums[:, 1]) / sums[:, 2]
    return diff, float(np.percentile(spread, 2.5)), float(np.percentile(spread, 97.5))


def paired_report(records: list[dict],
                  pairs: tuple[tuple[str, str], ...] = PAIRS) -> str:
    """A row per stream length and budget, a column per (policy, against) pair that both ran
    (paired_row)."""
    lengths = sorted({r["seconds"] for r in records})
    budgets = sorted({float(r["condition"].split("@")[1]) for r in records
                      if "@" in r["condition"]})
    pairs = [(a, b) for a, b in pairs
             if any(r["condition"].startswith(f"{a}@") for r in records)
             and any(r["condition"].startswith(f"{b}@") for r in records)]
    rows = [paired_row(records, pairs, seconds, fraction)
            for seconds in lengths for fraction in budgets]
    return md_table(["stream", "budget", *(f"{a} - {b}" for a, b in pairs)], rows)


def paired_row(records: list[dict], pairs: list[tuple[str, str]], seconds: int,
               fraction: float) -> list[str]:
    """The stream and budget, then per (policy, against) pair the paired difference in points
    with its interval ("-" where the records lack one)."""
    row = [f"{seconds} s", f"{100 * fraction:g} %"]
    for a, b in pairs:
        d = paired(records, a, b, seconds, fraction)
        row.append("-" if d is None else f"{d[0]:+.0f} ({d[1]:+.0f} to {d[2]:+.0f})")
    return row


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
    return save_figure(fig, out / "busy_retention.png")


def save_figure(fig: Any, path: Path) -> Path:
    """Lay the figure out, write it to path (its folder made) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
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
    args, results, records, _ = run_answers("busy_retention", parser, argv, evaluate)
    table = aggregate(records)
    results["table"] = table
    title = (f"Retention in the busy world: {Path(results['model']).name}, {args.objects} "
             "objects a stream")
    lengths = " · ".join(f"{s} s" for s in sorted({r["seconds"] for r in records}))
    body = (f"In short, % correct at {lengths} (the tables below give the intervals):\n\n"
            + summary(table) + "\n" + report(table, records))
    body += ("\nPer stream length and budget: the best policy, the state-based policies level "
             "with it (share inside its 95 % interval) and whether DeltaS is ahead of the "
             "controls by more than the intervals:\n\n" + verdicts(table))
    body += ("\nPer token against per chunk on the same questions: the difference in points "
             f"correct (95 % bootstrap interval over streams, {BOOTSTRAP} draws):\n\n"
             + paired_report(records))
    body += f"\n![retention per policy]({plot(table, args.out).name})\n"
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
