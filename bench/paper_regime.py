"""The paper's regime: 30- and 60-minute streams kept at 1, 2 and 5 % of their tokens.

Why: the method is meant for streams far longer than any budget: an hour of camera of which the
memory holds a few dozen chunks. bench/busy_retention.py measures minutes at 2-25 %; this
measures the hour world at the budgets of the paper, where every policy must let go of almost
everything.

How: held-out hour-world streams (scenes.HOUR, --objects objects of its own per 5-minute part;
seeds below samples.VALIDATION_SEEDS) per --lengths SECONDS:STREAMS (default 6 of 30 and 4 of
60 minutes). Each stream is rendered once and fed chunk by chunk, in one pass, to every memory of
this process: `full` (no eviction) and per policy one memory per budget of --fractions. A
budget M is that fraction of the stream's tokens (chat prefix included); the sinks are the chat
prefix, the window M / --window-share tokens (rounded, per cell), --buckets buckets: the same
for every policy, only the score differs. Each cell records how many chunks M holds (M over the
stream's mean tokens a chunk). After the stream every memory is asked the hour's questions
(bench/busy.py --hour: "did you see" about every object, a never-shown one per object), each
shown object placed by where it was last in view (early, middle, late third:
busy_retention.position). Reported: % correct with 95 % Wilson intervals per cell and per
position, the best policy per cell, paired differences against `surprise` (95 % bootstrap over
streams), and retention by stream time: per policy and budget, the share of each stream
minute's tokens still held at the end, when the questions are asked (paper_regime.png).

Two processes side by side (each takes every other policy of each stream, alternating which
one gets `full`), then the merge:

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.paper_regime --model DIR \\
        --part 1/2 --out bench/results/paper_regime/part1 &
    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.paper_regime --model DIR \\
        --part 2/2 --out bench/results/paper_regime/part2 &
    wait
    .venv/bin/python -m bench.paper_regime --report \\
        bench/results/paper_regime/part1/paper_regime.jsonl \\
        bench/results/paper_regime/part2/paper_regime.jsonl --out bench/results/paper_regime

The whole run takes hours (docs/evaluation.md); after a stop, the same command with
`--resume` goes on from the stream the stop cut off (bench.common.streams_done).

Honest limits: no policy can beat the `full` row, the model's own answer with everything kept;
a few long streams give wide intervals (read them; add streams with --first-seed where a cell
is undecided).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from deltas_ros.core.loader import LoadedModel
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.training.questions import is_correct
from deltas_ros.training.samples import sampled_chunks

from .answers import FULL
from .busy import busy_questions
from .busy_retention import (
    POSITIONS,
    aggregate,
    chunk_tokens,
    held_out_scene,
    order,
    paired_report,
    position,
    probe_memory,
    report,
    save_figure,
    verdicts,
)
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

AGAINST = "surprise"  # the default policy: every other one is compared with it
POLICIES = (FULL, "surprise", "deltas_surprise", "deltas", "write_strength", "infinipot_v",
            "streammem", "beta_error", "uniform", "recency")


def streams(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(seconds, seed) of every held-out stream, in the order every process walks them."""
    lengths = [tuple(int(v) for v in text.split(":")) for text in args.lengths]
    return [(seconds, seed) for seconds, count in lengths
            for seed in range(args.first_seed, args.first_seed + count)]


def my_policies(args: argparse.Namespace, stream_index: int) -> list[str]:
    """The --policies this process (--part K/N) runs on the stream_index-th stream: every N-th,
    shifted by one each stream so that `full`, the dearest, alternates between the processes."""
    part, parts = (int(v) for v in args.part.split("/"))
    return [p for i, p in enumerate(args.policies) if (i + stream_index) % parts == part - 1]


def budget_of(args: argparse.Namespace, fraction: float, tokens: int, sinks: int,
              ) -> tuple[int, int]:
    """(M, window) of a cell: M = fraction of the stream's tokens (at least the sinks and one
    more), window M / --window-share rounded, never past M - sinks."""
    budget = max(round(fraction * tokens), sinks + 1)
    return budget, min(round(budget / args.window_share), budget - sinks)


def cells(args: argparse.Namespace, policies: list[str], tokens: int, sinks: int,
          **fields: Any) -> dict[str, MemoryConfig]:
    """{condition: its memory's config}: `full` once, every other policy per --fractions;
    `fields` (seed, pixel budget, answer length) shared by all."""
    out = {}
    for policy in policies:
        if policy == FULL:
            out[FULL] = memory_config(args, budget_tokens=10**8, sink_tokens=sinks,
                                      policy=AGAINST, **fields)
            continue
        for fraction in args.fractions:
            budget, window = budget_of(args, fraction, tokens, sinks)
            out[f"{policy}@{fraction:g}"] = memory_config(
                args, budget_tokens=budget, window_tokens=window, sink_tokens=sinks,
                buckets=args.buckets, policy=policy, **fields)
    return out


def minute_tokens(chunks: list, counts: list[int], seconds: int,
                  held: dict[int, int] | None = None) -> list[int]:
    """Tokens per stream minute: those the chunks brought, or with `held` ({chunk index:
    tokens still held}) those still held."""
    per = [0] * math.ceil(seconds / 60)
    for index, ((_, times), brought) in enumerate(zip(chunks, counts)):
        per[min(int(times[0] // 60), len(per) - 1)] += \
            brought if held is None else held.get(index, 0)
    return per


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    done = streams_done(records_path, args.resume)
    pixel_budget, probe, sinks = probe_memory(args, loaded)
    with records_path.open("a") as out:
        for index, (seconds, seed) in enumerate(streams(args)):
            policies = my_policies(args, index)
            if not policies or (seconds, seed) in done:
                continue
            started = time.perf_counter()
            scene = held_out_scene(args, seconds, seed)
            chunks = sampled_chunks(scene)
            counts = chunk_tokens(probe, chunks)
            tokens = sinks + sum(counts)
            memories = {name: StreamingMemory(loaded, config) for name, config in cells(
                args, policies, tokens, sinks, seed=seed, pixel_budget=pixel_budget,
                max_new_tokens=args.max_new_tokens, evidence_candidates=0).items()}
            for frames, times in chunks:  # one pass over the frames for every memory
                for memory in memories.values():
                    memory.add_chunk(frames, times)
            print(f"{seconds:4d} s seed {seed}: {len(memories)} memories fed "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
            events = scene.events()
            qas = [qa for _, qa in busy_questions(events, seed, hour=True)]
            brought = minute_tokens(chunks, counts, seconds)
            for name, memory in memories.items():
                asked = time.perf_counter()
                common = {"seconds": seconds, "seed": seed, "condition": name,
                          "budget": memory.config.budget_tokens,
                          "window": memory.config.window_tokens, "sinks": sinks,
                          "tokens": tokens, "chunks": len(chunks)}
                held = {h.index: h.tokens for h in memory.stats().held}
                out.write(json.dumps(common | {
                    "minute_tokens": brought,
                    "held_tokens": minute_tokens(chunks, counts, seconds, held)}) + "\n")
                right = 0
                for qa in qas:
                    text = memory.ask(qa.question).text
                    right += is_correct(qa, text)
                    out.write(json.dumps(common | {
                        "question": qa.question, "truth": qa.answer, "answer": text,
                        "correct": is_correct(qa, text),
                        "position": position(events, qa.question, seconds)}) + "\n")
                out.flush()
                print(f"{seconds:4d} s seed {seed} {name:22s} {right}/{len(qas)} "
                      f"(questions {time.perf_counter() - asked:.1f} s)", flush=True)
            out.write(stream_done(seconds, seed))
            out.flush()


def budgets_report(records: list[dict]) -> str:
    """Per stream length and budget: M, the window and how many chunks M holds (M over the
    stream's mean tokens a chunk), means over the streams."""
    seen: dict[tuple[int, str], dict[int, dict]] = {}
    for r in records:
        if "@" in r["condition"]:
            key = (r["seconds"], r["condition"].split("@")[1])
            seen.setdefault(key, {})[r["seed"]] = r
    rows = []
    for (seconds, fraction), per in sorted(seen.items(), key=lambda kv: (kv[0][0],
                                                                        float(kv[0][1]))):
        n = len(per)
        budget = sum(r["budget"] for r in per.values()) / n
        window = sum(r["window"] for r in per.values()) / n
        per_chunk = sum((r["tokens"] - r["sinks"]) / r["chunks"] for r in per.values()) / n
        rows.append([minutes(seconds), f"{100 * float(fraction):g} %", f"{budget:.0f}",
                     f"{window:.0f}", f"{per_chunk:.1f}", f"{budget / per_chunk:.1f}", n])
    return md_table(["stream", "budget", "M (tokens)", "window", "tokens a chunk",
                     "chunks M holds", "streams"], rows)


def retention(records: list[dict]) -> dict[str, dict[str, list[list[int]]]]:
    """{condition: {seconds: [tokens held per minute, tokens brought per minute]}}, summed
    over streams."""
    table: dict[str, dict[str, list[list[int]]]] = {}
    for r in records:
        if "held_tokens" not in r:
            continue
        sums = table.setdefault(r["condition"], {}).setdefault(
            str(r["seconds"]), [[0] * len(r["held_tokens"]), [0] * len(r["minute_tokens"])])
        for total, values in zip(sums, (r["held_tokens"], r["minute_tokens"])):
            for minute, value in enumerate(values):
                total[minute] += value
    return table


def minutes(seconds: int) -> str:
    return f"{seconds / 60:.3g} min"


def thirds(sums: list[list[int]]) -> str:
    """% of the tokens held in the early, middle and late third of the stream's minutes ("-"
    for a third without a whole minute)."""
    held, brought = sums
    n = len(held)
    parts = [range(i * n // 3, (i + 1) * n // 3) for i in range(3)]
    return " · ".join(f"{100 * sum(held[m] for m in p) / max(sum(brought[m] for m in p), 1):.1f}"
                      if p else "-" for p in parts)


def retention_report(table: dict[str, Any]) -> str:
    lengths = sorted({int(s) for per in table.values() for s in per})
    rows = [[c] + [thirds(table[c][str(s)]) if str(s) in table[c] else "-" for s in lengths]
            for c in order(table) if c != FULL]
    return md_table(["condition"] + [f"{minutes(s)}: {' · '.join(POSITIONS)}"
                                     for s in lengths], rows)


def plot(table: dict[str, Any], out: Path) -> str:
    """% of each stream minute's tokens held at the end against the minute: a panel per
    stream length (rows) and budget (columns), a line per policy; its markdown ("" without a
    budget to draw)."""
    lengths = sorted({int(s) for per in table.values() for s in per})
    fractions = sorted({c.split("@")[1] for c in table if "@" in c}, key=float)
    if not fractions:
        return ""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({c.split("@")[0] for c in table if "@" in c})
    fig, axes = plt.subplots(len(lengths), len(fractions), squeeze=False, sharey="row",
                             figsize=(5 * len(fractions), 3.6 * len(lengths)))
    for row, seconds in zip(axes, lengths):
        for ax, fraction in zip(row, fractions):
            for i, policy in enumerate(policies):
                sums = table.get(f"{policy}@{fraction}", {}).get(str(seconds))
                if sums:
                    ax.plot([m + 0.5 for m in range(len(sums[0]))],
                            [100 * h / max(b, 1) for h, b in zip(*sums)],
                            color=plt.cm.tab10(i % 10), label=policy, marker="o",
                            markersize=2, linewidth=2.2 if policy == AGAINST else 1.1)
            ax.set_title(f"{minutes(seconds)} streams, budget {100 * float(fraction):g} %")
            ax.set_xlabel("stream minute")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("% of the minute's tokens held at the end")
    axes[0][-1].legend(fontsize=7, loc="upper left", ncol=2)
    path = save_figure(fig, out / "paper_regime.png")
    return f"\n![retention by stream time]({path.name})\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", default=["1800:6", "3600:4"],
                        help="SECONDS:STREAMS per stream length")
    parser.add_argument("--objects", type=int, default=3,
                        help="objects of its own per 5-minute part")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.05],
                        help="budgets as fractions of the stream's tokens")
    parser.add_argument("--window-share", type=float, default=8.0,
                        help="the recent window is M / this (the paper: 8)")
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        choices=[FULL, *POLICY_NAMES])
    parser.add_argument("--part", default="1/1",
                        help="K/N: run the K-th of N shares of the policies (N processes)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_resume_arg(parser)
    parser.set_defaults(hour=True)  # held_out_scene: the hour world
    add_answers_args(parser)
    args, results, records, _ = run_answers("paper_regime", parser, argv, evaluate)
    questions = [r for r in records if "question" in r]
    results["table"] = table = aggregate(questions)
    results["retention"] = kept = retention(records)
    policies = sorted({r["condition"].split("@")[0] for r in questions
                       if "@" in r["condition"]})
    pairs = tuple((p, AGAINST) for p in policies if p != AGAINST)
    title = (f"The paper's regime: {Path(results['model']).name} on held-out hour-world "
             f"streams, {args.objects} objects of its own per 5 minutes")
    body = ("Budgets: M (the sinks, the chat prefix, included), the recent window and how many "
            "chunks M holds:\n\n" + budgets_report(records)
            + "\n" + report(table, questions)
            + "\nPer stream length and budget: the best policy, the state-based policies "
            "level with it (share inside its 95 % interval):\n\n" + verdicts(table)
            + f"\nAgainst `{AGAINST}` on the same questions: the difference in points correct "
            "(95 % bootstrap interval over streams):\n\n" + paired_report(questions, pairs)
            + "\nRetention by stream time: % of the tokens of the early, middle and late third "
            "of the stream still held when the questions are asked:\n\n"
            + retention_report(kept) + plot(kept, args.out))
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
