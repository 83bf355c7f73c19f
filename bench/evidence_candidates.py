"""How many evidence candidates does the leave-one-out search need?

Why: an answer's evidence is found by leaving out, one at a time, the `evidence_candidates`
chunks the answer attended to most and keeping those whose absence costs the answer most
(core/asking.py). Each candidate is a row of a teacher-forced forward, so the count sets the
question's time: 32 rows at the 0.8B dimensions take most of a question with evidence
(docs/performance.md). Whether the attention's first few already hold the leave-one-out
winners decides how few are enough.

How: held-out busy streams (as bench.busy: seeds below the validation seeds, `--settings
OBJECTS:SECONDS`) through `StreamingMemory` at the node's defaults (M = 8192), then every
bench.busy question asked twice, with the memory rolled back between:
- with `--full` candidates tested (default 32) and that many chunks reported: the full
  leave-one-out ranking of the candidates;
- with none tested: the same chunks ranked by attention mass alone.
A search over the first k candidates by attention ranks them by the same drops (each row of the
batched forward is independent), so per question and k it is read off both rankings:
- top-1: the first k by attention contain the full search's winner (then the k-search reports
  that winner first);
- top-3: how much of the full search's top three the k-search's top three share, and how often
  they are the same set;
- on questions whose best drop is material (>= MATERIAL_DROP): top-1 again, and how much of
  the full search's best drop the k-search's best reaches;
- on "did you see" questions about a shown object: how often the k-search's strongest chunk
  lies at the object (within 1 s of a time it was in view, as bench.answers scores evidence).
The default count is the smallest k with top-1 >= 95 % and a top-3 overlap >= 90 %.

    python -m bench.evidence_candidates --streams 6 --out bench/results/evidence_candidates

Honest limits: one model (the shipped scene model) and one world; answers with no generated
token report no evidence and are left out (counted).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from deltas_ros.core.asking import leave_one_out_batched
from deltas_ros.core.loader import LoadedModel, resolve_pixel_budget
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.training.questions import identities_of, objects_of

from .answers import EVIDENCE_SLACK_S, wilson
from .busy import ask_about, busy_questions, busy_streams
from .common import add_answers_args, finish, md_table, memory_config, run_answers

KS = (1, 2, 4, 8, 16)
TOP1_AGREEMENT = 0.95
TOP3_OVERLAP = 0.90
# A drop below this (nats of the answer's log-probability: 1 %) means no single chunk carries
# the answer: the leave-one-out order among such chunks is rounding, not evidence.
MATERIAL_DROP = 0.01


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    full = memory_config(args, pixel_budget=pixel_budget, max_new_tokens=args.max_new_tokens,
                         evidence_chunks=args.full, evidence_candidates=args.full)
    mass = replace(full, evidence_candidates=0)
    with records_path.open("a") as out:
        for stream in busy_streams(args, loaded, full):
            memory = stream.memory
            events = stream.scene.events()
            spans = shown_spans(events)
            for kind, qa in busy_questions(events, stream.seed):
                memory.config = full
                searched = memory.ask(qa.question)
                memory.config = mass
                attended = memory.ask(qa.question)
                drops = search_drops(memory, qa.question, searched.text,
                                     attended.evidence_times)
                out.write(json.dumps({
                    "setting": stream.setting, "seed": stream.seed, "kind": kind,
                    "question": qa.question, "answer": searched.text,
                    "same_answer": searched.text == attended.text,
                    "truncated": searched.truncated,
                    "search_ms": searched.latency_ms - attended.latency_ms,
                    "searched": searched.evidence_times,
                    "attended": attended.evidence_times, "drops": drops,
                    "shown": spans.get(qa.question, [])}) + "\n")
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


def search_drops(memory: StreamingMemory, question: str, answer: str,
                 times: list[float]) -> list[float]:
    """The leave-one-out drop of each chunk at `times` for this answer, as the search computes
    it (the answer re-tokenized from its text; `consistent` checks the ranking it gives)."""
    chunk_at = {memory.slots.chunk_time(c): c for c in memory.slots.retained_chunks()}
    candidates = [chunk_at[t] for t in times]
    ids = memory.layout.question_ids(memory.tokenizer, question)
    answer_ids = memory.tokenizer.encode(answer, add_special_tokens=False)
    if not answer_ids:
        return []
    drops = leave_one_out_batched(memory.backend, memory.slots, ids, answer_ids,
                                  memory.next_position, candidates, None, math.inf)
    return [drops[c] for c in candidates]


def k_search(attended: list[float], searched: list[float], k: int) -> list[float]:
    """What a search over the first k candidates by attention reports, best first: those k in
    the full search's order (the same drops), then the untested ones in attention order."""
    tested = set(attended[:k])
    return [c for c in searched if c in tested] + attended[k:]


def agreement(records: list[dict], k: int) -> dict[str, Any]:
    """For k candidates: top-1 hits, top-3 overlap (mean share) and same top-3 sets; on the
    questions with a material drop, top-1 hits and the share of the full search's best drop
    that the k-search's best reaches; on "did you see" questions about a shown object, how often
    the k-search's strongest evidence lies at the object (within EVIDENCE_SLACK_S of a time it
    was in view)."""
    top1 = overlap = same = 0
    material, event = [0, 0], [0, 0]
    captured = 0.0
    for r in records:
        mine = k_search(r["attended"], r["searched"], k)
        if r["shown"]:
            event[0] += at_event(mine[0], r["shown"])
            event[1] += 1
        hit = mine[0] == r["searched"][0]
        top1 += hit
        shared = len(set(mine[:3]) & set(r["searched"][:3]))
        overlap += shared / min(3, len(r["searched"]))
        same += set(mine[:3]) == set(r["searched"][:3])
        best = max(r["drops"], default=0.0)
        if best >= MATERIAL_DROP:
            material[0] += hit
            material[1] += 1
            captured += max(r["drops"][:k]) / best
    n = len(records)
    return {"k": k, "n": n, "top1": [top1, n], "top3_overlap": overlap / n if n else 0.0,
            "top3_same": [same, n], "material_top1": material,
            "material_captured": captured / material[1] if material[1] else 0.0,
            "at_event": event}


def usable(records: list[dict]) -> list[dict]:
    """Questions whose evidence both rankings report (an empty answer reports none)."""
    return [r for r in records
            if r["searched"] and r["attended"] and r["drops"] and not r["truncated"]]


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


def report(records: list[dict], ks: list[int], full: int) -> tuple[str, dict[str, Any]]:
    kept = usable(records)
    groups = {"all": kept} | {f"{s.split(':')[1]} s": [r for r in kept if r["setting"] == s]
                              for s in sorted({r["setting"] for r in kept},
                                              key=lambda s: int(s.split(":")[1]))}
    tables: dict[str, list[dict]] = {name: [agreement(rs, k) for k in ks]
                                     for name, rs in groups.items() if rs}
    chosen = default_k(tables["all"]) if kept else None
    streams = len({(r["setting"], r["seed"]) for r in records})
    body = (f"{len(kept)} questions with evidence of {len(records)} asked ({streams} streams); "
            f"agreement with the {full}-candidate search, % (95 % Wilson interval):\n\n")
    headers = ["k candidates", *(f"top-1, {g}" for g in tables), "top-3 overlap, all",
               "same top-3 set, all", "top-1, material drop", "best drop reached",
               "evidence at the object"]
    rows = [[k, *(_share(tables[g][i]["top1"]) for g in tables),
             f"{100 * tables['all'][i]['top3_overlap']:.1f}",
             _share(tables["all"][i]["top3_same"]),
             _share(tables["all"][i]["material_top1"]),
             f"{100 * tables['all'][i]['material_captured']:.1f}",
             _share(tables["all"][i]["at_event"])] for i, k in enumerate(ks)]
    body += md_table(headers, rows)
    material = tables["all"][0]["material_top1"][1] if kept else 0
    body += (f"\nMaterial drop: the full search's best drop is at least {MATERIAL_DROP} nats "
             f"({material} of {len(kept)} questions); best drop reached: the k-search's best "
             "drop as a share of the full search's, mean over those questions.\n")
    rule = (f"top-1 >= {100 * TOP1_AGREEMENT:.0f} % and top-3 overlap >= "
            f"{100 * TOP3_OVERLAP:.0f} %")
    body += (f"\nSmallest k with {rule}: **{chosen}**.\n" if chosen
             else f"\nNo k of {ks} meets {rule}.\n")
    same = sum(r["same_answer"] for r in records)
    body += (f"\nThe answer with and without the search is the same in {same} of "
             f"{len(records)} questions (the question's memory is rolled back in between).\n")
    return body, {"tables": tables, "default_k": chosen, "questions": len(records),
                  "with_evidence": len(kept)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=6, help="streams per setting")
    parser.add_argument("--settings", nargs="+", default=["8:120", "12:300"],
                        help="OBJECTS:SECONDS per setting")
    parser.add_argument("--full", type=int, default=32, help="candidates of the full search")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_answers_args(parser)
    args, results, records, _ = run_answers("evidence_candidates", parser, argv, evaluate)
    body, summary = report(records, sorted({*args.ks, args.full}), args.full)
    results |= summary
    title = "Evidence candidates: the attention's first k against the full leave-one-out search"
    return finish(args.out, results, title, body)


if __name__ == "__main__":
    main()
