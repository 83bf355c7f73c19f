"""Which shown objects a policy loses at a tight budget in the busy world, and what they share.

Why: bench/busy_retention.py says how often a policy answers "did you see" right; where a
policy misses, this says which objects it lost and whether its score ranked them low or the
budget ran out: the "why" behind a missed cell.

How: the held-out busy streams of bench/busy_retention.py (the same seeds, objects, sinks,
window and buckets) run through `StreamingMemory` once per --policies entry at --fraction of the
stream's tokens, every token's score recorded as the policy gives it. After the stream, per
object identity shown: "Did you see a <colour> <shape>?" scored as there; the tokens still held
from the chunks it was in view; its best token's score as a percentile of the stream's scores;
and what it shares with the objects shown before it: `new` (neither its colour nor its shape
seen before), `shares` (its colour or shape seen before on another object) or `again` (it
comes back into view later: shown twice).

    python -m bench.busy_misses --seconds 120 300 --out bench/results/busy_retention/misses

Honest limits: 10 streams give a few dozen objects per group: read the counts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltas_ros.core.loader import LoadedModel, resolve_pixel_budget
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES
from deltas_ros.core.slot_table import PREFIX_CHUNK
from deltas_ros.training.questions import identities_of, is_correct

from .answers import wilson
from .busy import ask_about
from .busy_retention import busy_streams, position
from .common import add_answers_args, finish, md_table, memory_config, run_answers

GROUPS = ("new", "shares", "again")
HALF_CHUNK_S = 0.25  # a chunk's frames lie this far either side of its time (2 frames at 2 fps)


def sharing(events: list[dict], colour: str, shape: str) -> str:
    """`again` if the identity is shown more than once, else what it shares with the objects
    shown before it."""
    objects = [e for e in events if e.get("kind") == "object"]
    mine = [e["time"] for e in objects if (e["colour"], e["shape"]) == (colour, shape)]
    if len(mine) > 1:
        return "again"
    if any(e["colour"] == colour or e["shape"] == shape for e in objects if e["time"] < mine[0]):
        return "shares"
    return "new"


def in_view(events: list[dict], colour: str, shape: str, times: np.ndarray) -> np.ndarray:
    """(n,) bool: whether the identity was in view in the chunk at each of these stream times."""
    mask = np.zeros(len(times), bool)
    for e in events:
        if e.get("kind") == "object" and (e["colour"], e["shape"]) == (colour, shape):
            mask |= (times + HALF_CHUNK_S >= e["time"]) & (times - HALF_CHUNK_S <= e["end"])
    return mask


def evaluate(args: argparse.Namespace, loaded: LoadedModel, records_path: Path) -> None:
    pixel_budget = resolve_pixel_budget(args.pixel_budget, loaded.path)
    probe = StreamingMemory(loaded, MemoryConfig(pixel_budget=pixel_budget))
    sinks = probe.kv_tokens
    with records_path.open("a") as out:
        for seconds, seed, chunks, events, tokens in busy_streams(args, probe):
            budget = max(round(args.fraction * tokens), sinks + args.window + 1)
            for policy in args.policies:
                started = time.perf_counter()
                memory = StreamingMemory(loaded, memory_config(
                    args, budget_tokens=budget, sink_tokens=sinks, policy=policy, seed=seed,
                    pixel_budget=pixel_budget, max_new_tokens=args.max_new_tokens,
                    evidence_candidates=0))
                scores, times = [], []
                for frames, stamps in chunks:
                    memory.add_chunk(frames, stamps)
                    newest = memory.slots.chunk == memory.chunks_seen - 1
                    scores.append(memory.slots.score[newest])  # its scores as given
                    times.append(np.full(int(scores[-1].numel()), np.mean(stamps)))
                all_scores, all_times = torch.cat(scores).numpy(), np.concatenate(times)
                held = memory.slots.time.numpy()[memory.slots.chunk.numpy() != PREFIX_CHUNK]
                on_objects = np.zeros(len(held), bool)
                for shown in identities_of(events):
                    on_objects |= in_view(events, shown["colour"], shown["shape"], held)
                for shown in identities_of(events):
                    colour, shape = shown["colour"], shown["shape"]
                    qa = ask_about("seen", events, colour, shape)
                    best = all_scores[in_view(events, colour, shape, all_times)].max()
                    out.write(json.dumps({
                        "seconds": seconds, "seed": seed, "policy": policy,
                        "question": qa.question,
                        "correct": is_correct(qa, memory.ask(qa.question).text),
                        "held": int(in_view(events, colour, shape, held).sum()),
                        "stream_held": len(held),
                        "stream_off_objects": int((~on_objects).sum()),
                        "percentile": float((all_scores < best).mean()),
                        "group": sharing(events, colour, shape),
                        "position": position(events, qa.question, seconds)}) + "\n")
                out.flush()
                print(f"{seconds:4d} s seed {seed} {policy:16s} "
                      f"({time.perf_counter() - started:.1f} s)", flush=True)


def report(records: list[dict]) -> str:
    """Per policy and length: correct, tokens held and score percentile by group and outcome."""
    rows = []
    keys = sorted({(r["policy"], r["seconds"]) for r in records})
    for policy, seconds in keys:
        mine = [r for r in records if (r["policy"], r["seconds"]) == (policy, seconds)]
        for group in (*GROUPS, "all"):
            these = [r for r in mine if group in ("all", r["group"])]
            if not these:
                continue
            hits = sum(r["correct"] for r in these)
            low, high = wilson(hits, len(these))
            missed = [r for r in these if not r["correct"]]
            rows.append([policy, f"{seconds} s", group, len(these),
                         f"{100 * hits / len(these):.0f} ({100 * low:.0f}-{100 * high:.0f})",
                         f"{np.mean([r['held'] == 0 for r in these]):.2f}",
                         sum(r["held"] == 0 for r in missed),
                         f"{np.mean([r['held'] for r in these if r['held']] or [0]):.1f}",
                         f"{np.median([r['percentile'] for r in these]):.2f}",
                         f"{np.median([r['percentile'] for r in missed]):.2f}" if missed
                         else "-",
                         ", ".join(f"{p} {sum(r['position'] == p for r in missed)}"
                                   for p in ("early", "middle", "late")) if missed else "-"])
    streams = []
    for policy, seconds in keys:
        per_stream = {r["seed"]: r for r in records
                      if (r["policy"], r["seconds"]) == (policy, seconds)}.values()
        streams.append([policy, f"{seconds} s", len(per_stream),
                        f"{np.mean([r['stream_held'] for r in per_stream]):.1f}",
                        f"{np.mean([r['stream_off_objects'] for r in per_stream]):.1f}"])
    return ("Per object identity shown: % answered \"did you see\" right (95 % Wilson interval); "
            "share with no token held from the chunks it was in view, and how many of the "
            "missed; tokens held per object "
            "that holds any; its best token's score "
            "as a percentile of the stream's tokens (median), over all and over the missed; "
            "where the missed ones were last in view:\n\n"
            + md_table(["policy", "length", "group", "objects", "correct", "none held",
                        "missed, none held", "tokens held", "percentile",
                        "percentile (missed)", "missed at"], rows)
            + "\nPer stream (mean): tokens held beyond the chat prefix (the recent window "
            "included) and those from chunks in which no object was in view:\n\n"
            + md_table(["policy", "length", "streams", "tokens held", "no object in view"],
                       streams))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=10, help="streams per length")
    parser.add_argument("--objects", type=int, default=8, help="objects per stream")
    parser.add_argument("--seconds", type=int, nargs="+", default=[120, 300])
    parser.add_argument("--fraction", type=float, default=0.02,
                        help="budget as a fraction of the stream's tokens")
    parser.add_argument("--window", type=int, default=14, help="recent window (tokens)")
    parser.add_argument("--policies", nargs="+", default=["surprise", "infinipot_v", "deltas"],
                        choices=list(POLICY_NAMES))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    add_answers_args(parser)
    args, results, records, _ = run_answers("busy_misses", parser, argv, evaluate)
    results["fraction"] = args.fraction
    title = f"Objects lost in the busy world at {100 * args.fraction:g} % of the tokens"
    return finish(args.out, results, title, report(records))


if __name__ == "__main__":
    main()
