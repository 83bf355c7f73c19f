"""How many evidence candidates does the leave-one-out search need, and ranked by what?

Why: an answer's evidence is found by leaving out, one at a time, the `evidence_candidates`
chunks ranked first and keeping those whose absence costs the answer most (core/asking.py).
Each candidate is a row of a teacher-forced forward, so the count sets the question's time: 32
rows at the 0.8B dimensions take most of a question with evidence (docs/performance.md). How
few are enough depends on how well the ranking finds the leave-one-out winners before testing
them: by the attention mass the answer put on each chunk, or by the first-order estimate of
each chunk's drop (`asking.estimated_drops`: one forward and backward for all chunks), which
questions use.

How: held-out busy streams (as bench.busy: seeds below the validation seeds, `--settings
OBJECTS:SECONDS`) through `StreamingMemory` at the node's defaults (M = 8192), then every
bench.busy question asked once (no search: the answer and every chunk in attention order),
and for that answer every chunk the question saw left out in turn (the exhaustive search, the
yardstick) and every chunk's estimate. A search over the first k of a ranking reports those k
by their exact drops (each row of the batched forward is independent), then the rest in the
ranking's order, so per question, ranking and k it is read off:
- top-1: the first k contain the exhaustive search's winner (then the k-search reports it
  first);
- top-3: how much of the exhaustive search's top three the k-search's top three share, and how
  often they are the same set;
- on questions whose best drop is material (>= MATERIAL_DROP): top-1 again, and how much of
  the best drop the k-search's best reaches;
- on "did you see" questions about a shown object: how often the k-search's strongest chunk
  lies at the object (within 1 s of a time it was in view, as bench.answers scores evidence).
The default count is the smallest k whose search by estimate has top-1 >= 95 % and a top-3
overlap >= 90 %.

    python -m bench.evidence_candidates --streams 6 --out bench/results/evidence_candidates

Honest limits: one model (the shipped scene model) and one world; answers with no generated
token report no evidence and are left out (counted); the exhaustive search re-tokenizes the
answer's text, as a search over the words a planner read.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from deltas_ros.core.asking import estimated_drops, leave_one_out_batched
from deltas_ros.core.loader import LoadedModel, resolve_pixel_budget
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.training.questions import identities_of, objects_of

from .answers import EVIDENCE_SLACK_S, wilson
from .busy import ask_about, busy_questions, busy_streams
from .common import add_answers_args, finish, md_table, median, memory_config, run_answers

KS = (1, 2, 4, 8, 16, 32)
RANKINGS = ("attention", "estimate")
TOP1_AGREEMENT = 0.95
TOP3_OVERLAP = 0.90
# A drop below this (nats of the answer's log-probability: 1 %) means no single chunk carries
# the answer: the leave-one-out order among such chunks is rounding, not evidence.
MATERIAL_DROP = 0.01


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    config = memory_config(args, pixel_budget=pixel_budget, max_new_tokens=args.max_new_tokens)
    every_chunk = replace(config, evidence_candidates=0, evidence_chunks=10**9)
    with records_path.open("a") as out:
        for stream in busy_streams(args, loaded, every_chunk):
            events = stream.scene.events()
            spans = shown_spans(events)
            for kind, qa in busy_questions(events, stream.seed):
                attended = stream.memory.ask(qa.question)
                ranked = exact_and_estimated(stream.memory, qa.question, attended.text,
                                             attended.evidence_times)
                out.write(json.dumps({
                    "setting": stream.setting, "seed": stream.seed, "kind": kind,
                    "question": qa.question, "answer": attended.text,
                    "truncated": attended.truncated, "chunks": attended.evidence_times,
                    **ranked, "shown": spans.get(qa.question, [])}) + "\n")
            out.flush()
            stream.log()


def shown_spans(events: list[dict]) -> dict[str, list[list[float]]]:
    """{"did you see" question about a shown object: the [start, end] of each time it was in
    view}: where its evidence should lie."""
    return {ask_about("seen", events, o["colour"], o["shape"]).question:
            [[e["time"], e["end"]] for e in objects_of(events)
             if (e["colour"], e["shape"]) == (o["colour"], o["shape"])]
            for o in identities_of(events)}


def at_event(time: float, spans: list[list[float]]) -> bool:
    """Whether a chunk at `time` lies within EVIDENCE_SLACK_S of one of the spans."""
    return any(t0 - EVIDENCE_SLACK_S <= time <= t1 + EVIDENCE_SLACK_S for t0, t1 in spans)


def exact_and_estimated(memory: StreamingMemory, question: str, answer: str,
                        times: list[float]) -> dict[str, Any]:
    """For this answer, the exact leave-one-out drop ("drops") and the estimate ("estimates")
    of each chunk at `times`, in their order, as the search computes them, with the time each
    took (the answer re-tokenized from its text)."""
    chunk_at = {memory.slots.chunk_time(c): c for c in memory.slots.retained_chunks()}
    chunks = [chunk_at[t] for t in times]
    ids = memory.layout.question_ids(memory.tokenizer, question)
    answer_ids = memory.tokenizer.encode(answer, add_special_tokens=False)
    if not answer_ids:
        return {"drops": [], "estimates": []}
    backend, position = memory.backend, memory.next_position
    start = time.perf_counter()
    drops = leave_one_out_batched(backend, memory.slots, ids, answer_ids, position, chunks,
                                  None, math.inf)
    middle = time.perf_counter()
    estimates = estimated_drops(backend, memory.slots, ids, answer_ids, position, None)
    end = time.perf_counter()
    return {"drops": [drops[c] for c in chunks], "estimates": [estimates[c] for c in chunks],
            "exhaustive_ms": (middle - start) * 1e3, "estimate_ms": (end - middle) * 1e3}


def ranking(record: dict, by: str) -> list[float]:
    """The record's chunks in the order `by` ranks them: "attention" (as asked), "estimate"
    (largest estimated drop first) or "drop" (the exhaustive search's order); ties keep the
    attention order."""
    if by == "attention":
        return record["chunks"]
    values = record["estimates" if by == "estimate" else "drops"]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return [record["chunks"][i] for i in order]


def k_search(ranked: list[float], searched: list[float], k: int) -> list[float]:
    """What a search over the first k of a ranking reports, best first: those k in the
    exhaustive search's order (the same drops), then the untested ones in the ranking's
    order."""
    tested = set(ranked[:k])
    return [c for c in searched if c in tested] + ranked[k:]


def agreement(records: list[dict], k: int, by: str) -> dict[str, Any]:
    """For k candidates ranked `by`: top-1 hits, top-3 overlap (mean share) and same top-3
    sets; on the questions with a material drop, top-1 hits and the share of the exhaustive
    search's best drop that the k-search's best reaches; on "did you see" questions about a
    shown object, how often the k-search's strongest evidence lies at the object (within
    EVIDENCE_SLACK_S of a time it was in view)."""
    top1 = overlap = same = 0
    material, event = [0, 0], [0, 0]
    captured = 0.0
    for r in records:
        searched, ranked = ranking(r, "drop"), ranking(r, by)
        mine = k_search(ranked, searched, k)
        if r["shown"]:
            event[0] += at_event(mine[0], r["shown"])
            event[1] += 1
        hit = mine[0] == searched[0]
        top1 += hit
        shared = len(set(mine[:3]) & set(searched[:3]))
        overlap += shared / min(3, len(searched))
        same += set(mine[:3]) == set(searched[:3])
        best = max(r["drops"], default=0.0)
        if best >= MATERIAL_DROP:
            material[0] += hit
            material[1] += 1
            drop_of = dict(zip(r["chunks"], r["drops"]))
            captured += max(drop_of[c] for c in ranked[:k]) / best
    n = len(records)
    return {"k": k, "by": by, "n": n, "top1": [top1, n],
            "top3_overlap": overlap / n if n else 0.0, "top3_same": [same, n],
            "material_top1": material,
            "material_captured": captured / material[1] if material[1] else 0.0,
            "at_event": event}


def usable(records: list[dict]) -> list[dict]:
    """Questions with evidence (an empty answer reports none)."""
    return [r for r in records if r["chunks"] and r["drops"] and not r["truncated"]]


def default_k(rows: list[dict]) -> int | None:
    """The smallest k that meets both bars (None: none of them does)."""
    return next((row["k"] for row in rows
                 if row["top1"][0] >= TOP1_AGREEMENT * row["n"]
                 and row["top3_overlap"] >= TOP3_OVERLAP), None)


def _share(hits: list[int]) -> str:
    if not hits[1]:
        return "-"
    lo, hi = wilson(*hits)
    return f"{100 * hits[0] / hits[1]:.1f} ({100 * lo:.0f}-{100 * hi:.0f})"


def report(records: list[dict], ks: list[int]) -> tuple[str, dict[str, Any]]:
    kept = usable(records)
    settings = sorted({r["setting"] for r in kept}, key=lambda s: int(s.split(":")[1]))
    groups = {"all": kept} | {f"{s.split(':')[1]} s": [r for r in kept if r["setting"] == s]
                              for s in settings}
    tables = {(name, by): [agreement(rs, k, by) for k in ks]
              for name, rs in groups.items() if rs for by in RANKINGS}
    chosen = default_k(tables["all", "estimate"]) if kept else None
    streams = len({(r["setting"], r["seed"]) for r in records})
    body = (f"{len(kept)} questions with evidence of {len(records)} asked ({streams} streams); "
            "agreement of a search over a ranking's first k with the exhaustive search (every "
            "chunk the question saw left out), % (95 % Wilson interval):\n\n")
    per_setting = [g for g in groups if g != "all"]
    headers = ["k candidates", "top-1, by attention", "top-1, by estimate",
               *(f"top-1, by estimate, {g}" for g in per_setting),
               "top-3 overlap, by attention", "top-3 overlap, by estimate",
               "same top-3 set, by estimate", "top-1, material drop, by estimate",
               "best drop reached, by estimate", "evidence at the object, by estimate"]
    rows = []
    for i, k in enumerate(ks):
        att, est = tables["all", "attention"][i], tables["all", "estimate"][i]
        rows.append([k, _share(att["top1"]), _share(est["top1"]),
                     *(_share(tables[g, "estimate"][i]["top1"]) for g in per_setting),
                     f"{100 * att['top3_overlap']:.1f}", f"{100 * est['top3_overlap']:.1f}",
                     _share(est["top3_same"]), _share(est["material_top1"]),
                     f"{100 * est['material_captured']:.1f}", _share(est["at_event"])])
    body += md_table(headers, rows)
    material = tables["all", "estimate"][0]["material_top1"][1] if kept else 0
    body += (f"\nMaterial drop: the exhaustive search's best drop is at least {MATERIAL_DROP} "
             f"nats ({material} of {len(kept)} questions); best drop reached: the k-search's "
             "best drop as a share of the exhaustive search's, mean over those questions.\n")
    rule = (f"top-1 >= {100 * TOP1_AGREEMENT:.0f} % and top-3 overlap >= "
            f"{100 * TOP3_OVERLAP:.0f} %")
    body += (f"\nSmallest k ranked by estimate with {rule}: **{chosen}**.\n" if chosen
             else f"\nNo k of {ks} ranked by estimate meets {rule}.\n")
    timed = [r for r in kept if "estimate_ms" in r]
    if timed:
        estimate, exhaustive = (median([r[key] for r in timed])
                                for key in ("estimate_ms", "exhaustive_ms"))
        body += (f"\nOn this model (medians): the estimate {estimate:.0f} ms for every chunk, "
                 f"the exhaustive search {exhaustive:.0f} ms; bench.real_size times them at "
                 "the real sizes.\n")
    summary = {"tables": {f"{name}, by {by}": rows for (name, by), rows in tables.items()},
               "default_k": chosen, "questions": len(records), "with_evidence": len(kept)}
    return body, summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=6, help="streams per setting")
    parser.add_argument("--settings", nargs="+", default=["8:120", "12:300", "12:600"],
                        help="OBJECTS:SECONDS per setting")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_answers_args(parser)
    args, results, records, _ = run_answers("evidence_candidates", parser, argv, evaluate)
    body, summary = report(records, sorted(set(args.ks)))
    results |= summary
    title = ("Evidence candidates: a search over the first k, by attention or by estimate, "
             "against the exhaustive leave-one-out search")
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
