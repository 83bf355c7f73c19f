"""Answers per retention policy: can the memory still answer about what the camera showed?

Why: retention is only worth its cost if the kept tokens let the model answer later questions.
The shipped scene model (deltas_ros/models/scenes-tiny, trained by `deltas-ros train`) answers
questions about generated scene streams, so answers can be scored against the ground truth.

How: held-out scene streams (seeds below train.VALIDATION_SEEDS: never used in training or model
selection) at the training length (--seconds, the validation length of the training config) and
at --lengths multiples of it, with the scene options of the training's last stage. Each stream
runs through `StreamingMemory` chunk by chunk, exactly as the node feeds it, once per condition:
`full` (no eviction), `state` (only sinks + the recent window are kept: what the recurrent state
carries), and every policy of POLICY_NAMES plus the pixel-difference baseline of
bench/retention.py at budgets of --fractions of the stream's tokens. After the whole stream the
same questions are asked in every condition, about events anywhere in it: per object its colour,
its shape, "did you see" it (yes) and when it appeared; as many "did you see" about pairs that
were not there (no: same shape or colour when possible); what appeared; how many. Answers are
the model's greedy words, scored by questions.is_correct. 95 % Wilson intervals. Also recorded:
each answer's evidence times, and how often the strongest one lies at the event asked about.

    python -m bench.answers --streams 10 --out bench/results            # run + report
    python -m bench.answers --report a.jsonl b.jsonl --out bench/results # merge runs

Honest limits: a tiny model on synthetic scenes; a few streams per length (intervals are wide,
read them); the chunk time text is the only clock the model has.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from deltas_ros.core.config import DEFAULT_PIXEL_BUDGET
from deltas_ros.core.loader import (
    LoadedModel,
    resolve_pixel_budget,
)
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.training.config import Stage
from deltas_ros.training.questions import (
    FORMS,
    QA,
    TARGET_FORMS,
    is_correct,
    make_question,
    objects_of,
)
from deltas_ros.training.samples import VALIDATION_SEEDS, sampled_chunks
from deltas_ros.training.scenes import SceneOptions, SceneStream

from .common import add_answers_args, finish, md_table, memory_config, run_answers
from .retention import PIXEL_DIFF, engine_policy, stream_into

FULL, STATE = "full", "state"
# The scene options of config/train_tiny.yaml's last stage.
EVAL_STAGE = Stage(0, scenes=SceneOptions(objects=(1, 3), cuts=(0, 1), distractors=(0, 2)))


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def stream_questions(events: list[dict], seed: int) -> list[tuple[QA, list[float] | None]]:
    """The questions every condition is asked about one stream (see the module docstring),
    each with the [appear, leave] stream times of the one object it is about (None for
    questions about none or all)."""
    rng = np.random.default_rng((seed, 11))
    qas = []
    for obj in objects_of(events):
        qas += [(make_question(form, events, rng, about=obj), [obj["time"], obj["end"]])
                for form in ("colour", "shape", "seen", "when")]
        for _ in range(100):  # a negative "seen": drawn until the pair was not in the stream
            qa = make_question("seen", events, rng)
            if qa.answer.split()[-1] == "no":  # the verdict
                qas.append((qa, None))
                break
    qas += [(make_question("appeared", events, rng), None),
            (make_question("count", events, rng), None)]
    return qas


def run_condition(loaded: LoadedModel, chunks: list, qas: list[QA], config: MemoryConfig,
                  pixel_diff: bool) -> list[tuple[QA, str, list[float]]]:
    memory = StreamingMemory(loaded, config)
    stream_into(memory, chunks, pixel_diff)
    asked = [memory.ask(qa.question) for qa in qas]
    return [(qa, a.text, a.evidence_times) for qa, a in zip(qas, asked)]


def conditions(args: argparse.Namespace, tokens: int, sinks: int) -> list[tuple[str, int, str]]:
    """(name, budget, policy) per condition for a stream of `tokens` tokens."""
    out = [(FULL, 10**8, "deltas"), (STATE, sinks + args.window, "recency")]
    for fraction in args.fractions:
        budget = max(round(fraction * tokens), sinks + args.window + 1)
        out += [(f"{policy}@{fraction:g}", budget, policy) for policy in args.policies]
    return out


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    probe = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    sinks = probe.kv_tokens  # the chat prefix: kept whatever the budget
    with records_path.open("a") as out:
        for multiple in args.lengths:
            seconds = round(args.seconds * multiple)
            for seed in range(args.first_seed, args.first_seed + args.streams):
                if seed >= VALIDATION_SEEDS:
                    raise ValueError("evaluation seeds must stay below the validation seeds")
                scene = SceneStream(seconds, args.width, args.height, seed, EVAL_STAGE.scenes)
                chunks = sampled_chunks(scene)
                events = scene.events()
                asked = stream_questions(events, seed)
                qas = [qa for qa, _ in asked]
                tokens = sinks + sum(probe.builder.build(f, t, 0).num_tokens for f, t in chunks)
                for name, budget, policy in conditions(args, tokens, sinks):
                    started = time.perf_counter()
                    config = memory_config(
                        args, budget_tokens=budget, sink_tokens=sinks, seed=seed,
                        policy=engine_policy(policy), pixel_budget=pixel_budget,
                        max_new_tokens=24)
                    answers = run_condition(loaded, chunks, qas, config, policy == PIXEL_DIFF)
                    for (qa, text, evidence), (_, span) in zip(answers, asked):
                        out.write(json.dumps({
                            "multiple": multiple, "seconds": seconds, "seed": seed,
                            "condition": name, "budget": budget, "tokens": tokens,
                            "form": qa.form, "question": qa.question, "truth": qa.answer,
                            "answer": text, "correct": is_correct(qa, text),
                            "evidence": evidence, "shown": span}) + "\n")
                    out.flush()
                    print(f"{seconds:4d} s seed {seed} {name:20s} "
                          f"{sum(is_correct(q, t) for q, t, _ in answers)}/{len(answers)} "
                          f"({time.perf_counter() - started:.1f} s)", flush=True)


def chunk_cost(loaded: LoadedModel, pixel_budget: int, chunks: int = 20) -> float:
    """Median ms per chunk (add_chunk) of 640x480 scene frames at this pixel budget."""
    memory = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    scene = SceneStream(chunks, 640, 480, 0, EVAL_STAGE.scenes)
    times = []
    for frames, stamps in sampled_chunks(scene):
        start = time.perf_counter()
        memory.add_chunk(frames, stamps)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times[2:]))


EVIDENCE_SLACK_S = 1.0  # the top evidence chunk "at the event": within this of the object's span


def evidence_at_event(record: dict) -> bool:
    """Whether the answer's strongest evidence chunk lies in the asked object's visible span."""
    t0, t1 = record["shown"]
    return bool(record["evidence"]) and \
        t0 - EVIDENCE_SLACK_S <= record["evidence"][0] <= t1 + EVIDENCE_SLACK_S


def aggregate(records: list[dict]) -> dict[str, Any]:
    """{condition: {multiple: {form or "target" or "evidence" or "evidence:<form>": [hits,
    n]}}}; "evidence": how often the top evidence chunk lies at the event (questions about one
    object), also per form."""
    table: dict[str, dict[str, dict[str, list[int]]]] = {}
    for r in records:
        cell = table.setdefault(r["condition"], {}).setdefault(str(r["multiple"]), {})
        keys = [(r["form"], r["correct"])]
        if r["form"] in TARGET_FORMS:
            keys.append(("target", r["correct"]))
        if r.get("shown"):
            at_event = evidence_at_event(r)
            keys += [("evidence", at_event), (f"evidence:{r['form']}", at_event)]
        for key, hit in keys:
            hits = cell.setdefault(key, [0, 0])
            hits[0] += bool(hit)
            hits[1] += 1
    return table


def cell(hits: list[int] | None) -> str:
    if not hits or not hits[1]:
        return "-"
    lo, hi = wilson(*hits)
    return f"{100 * hits[0] / hits[1]:.0f} ({100 * lo:.0f}-{100 * hi:.0f})"


def report(table: dict[str, Any], records: list[dict], seconds: float) -> str:
    multiples = sorted({r["multiple"] for r in records})
    streams = {m: len({r["seed"] for r in records if r["multiple"] == m}) for m in multiples}
    order = [FULL, STATE] + sorted((c for c in table if c not in (FULL, STATE)),
                                   key=lambda c: (float(c.split("@")[1]), c))
    headers = ["condition"] + [f"{m:g}x ({seconds * m:g} s, {streams[m]} streams)"
                               for m in multiples]
    rows = [[c] + [cell(table[c].get(str(m), {}).get("target")) for m in multiples]
            for c in order if c in table]
    forms_rows = [[f"{form}"] + [cell(table.get(FULL, {}).get(str(m), {}).get(form))
                                 for m in multiples] for form in FORMS]
    evidence_rows = [[c] + [cell(table[c].get(str(m), {}).get("evidence")) for m in multiples]
                     for c in order if c in table]
    full = [table.get(FULL, {}).get(str(m), {}) for m in multiples]
    evidence_forms = [[form] + [cell(per.get(f"evidence:{form}")) for per in full]
                      for form in FORMS if any(f"evidence:{form}" in per for per in full)]
    return ("Colour, shape and yes/no questions together, % correct (95 % Wilson interval):\n\n"
            + md_table(headers, rows)
            + "\nFull memory, per question form:\n\n" + md_table(["form"] + headers[1:],
                                                                  forms_rows)
            + f"\nEvidence at the event: questions about one object whose strongest evidence "
            f"chunk lies within {EVIDENCE_SLACK_S:g} s of the object's visible span, %:\n\n"
            + md_table(headers, evidence_rows)
            + "\nEvidence at the event with full memory, per question form, %:\n\n"
            + md_table(["form"] + headers[1:], evidence_forms))


def plot(table: dict[str, Any], out: Path, seconds: float) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = sorted({c.split("@")[1] for c in table if "@" in c}, key=float)
    fig, axes = plt.subplots(1, len(fractions), figsize=(6 * len(fractions), 4.2), sharey=True,
                             squeeze=False)
    for ax, fraction in zip(axes[0], fractions):
        names = [FULL, STATE] + sorted(c for c in table if c.endswith(f"@{fraction}"))
        for name in names:
            per = table[name]
            ms = sorted(per, key=float)
            acc = [per[m]["target"][0] / per[m]["target"][1] for m in ms]
            style = "k-" if name == FULL else "k:" if name == STATE else "-"
            width = 2.5 if name.startswith("deltas") or name == FULL else 1.2
            ax.plot([float(m) * seconds for m in ms], acc, style, marker="o",
                    linewidth=width, label=name.split("@")[0])
        ax.set_xscale("log")
        ax.set_title(f"budget {100 * float(fraction):g} % of the stream's tokens")
        ax.set_xlabel("stream length (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("colour/shape/yes-no accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "answers.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=10, help="streams per length")
    parser.add_argument("--seconds", type=float, default=20.0, help="the training length")
    parser.add_argument("--lengths", type=float, nargs="+", default=[1, 2, 5, 10],
                        help="stream lengths as multiples of --seconds")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25],
                        help="budgets as fractions of the stream's tokens")
    parser.add_argument("--window", type=int, default=14, help="recent window (tokens)")
    parser.add_argument("--policies", nargs="+", default=[*POLICY_NAMES, PIXEL_DIFF],
                        choices=[*POLICY_NAMES, PIXEL_DIFF])
    parser.add_argument("--cost", action="store_true",
                        help="also time a chunk: this model vs the tiny random test model")
    add_answers_args(parser)
    args, results, records, loaded = run_answers("answers", parser, argv, evaluate)
    if args.cost and loaded is not None:
        from .common import bench_model

        tiny = bench_model(argparse.Namespace(model=None, config=None, device="cpu",
                                              dtype="auto", seed=0))
        results["chunk_ms"] = {
            "shipped": chunk_cost(loaded, resolve_pixel_budget(None, loaded.path)),
            "tiny_random_default_budget": chunk_cost(tiny, DEFAULT_PIXEL_BUDGET)}
    table = aggregate(records)
    results |= {"table": table, "seconds": args.seconds}
    body = report(table, records, args.seconds)
    if "chunk_ms" in results:
        ms = results["chunk_ms"]
        body += (f"\nPer chunk (median add_chunk, 640x480 frames, each model at its default "
                 f"pixel budget): shipped {ms['shipped']:.1f} ms, tiny random test model "
                 f"{ms['tiny_random_default_budget']:.1f} ms.\n")
    body += f"\n![answers per policy]({plot(table, args.out, args.seconds).name})\n"
    title = "Answers per retention policy: the shipped scene model on held-out streams"
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
