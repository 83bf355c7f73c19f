"""Retention: after a whole stream, which policies still hold the chunks where something happened.

Why: the point of scoring chunks is to keep the eventful ones when the budget forces eviction.
synth_stream makes streams whose events (an object appears for 1-3 s, or the view cuts to a new
scene) are known, so "is the event still in memory at the end" can be counted.

How: for each seed, one stream (--seconds at 2 fps, events about every --event-every s) runs
through the engine once per policy of POLICY_NAMES and once with a pixel-difference baseline, at
two budgets (--fractions of the stream's tokens) with a small recent window, so most of the stream
must be evicted. The baseline is a RetentionPolicy defined here: a chunk's score is the mean
absolute pixel difference between its frames and the previous chunk's frames (0 for the first
chunk), set before each add_chunk, then the same select_keep machinery. Event chunks are chunks
with a frame showing an event: an object on screen, or the first chunk after a cut. Reported per
policy and budget, summed over seeds: the fraction of event chunks that still have tokens in
memory after the last chunk, and the chance level, the fraction of all chunks that do.

Honest limits: the model has random weights. Its state drift is at best a change detector (see
../shared/notes/qwen3_5-in-transformers.md); this measures the machinery (the signal reaches the
selection, the buckets and budget behave), not the paper's claim that DeltaS keeps what matters.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from deltas_ros.core.loader import LoadedModel
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES, ChunkSignals, RetentionPolicy
from deltas_ros.training.synth import synth_stream

from .common import (
    add_model_args,
    bench_model,
    describe_model,
    finish,
    md_table,
    memory_config,
    parse,
    percent,
    start_results,
)

FPS = 2.0
PIXEL_DIFF = "pixel_diff"


def engine_policy(policy: str) -> str:
    """The policy a condition's memory is built with: the pixel-difference baseline is no engine
    policy, so its memory is built with `deltas` and stream_into puts PixelDiffPolicy in place."""
    return "deltas" if policy == PIXEL_DIFF else policy


class PixelDiffPolicy(RetentionPolicy):
    """Mean absolute pixel difference to the previous chunk (set `next_score` before a chunk)."""

    name = PIXEL_DIFF

    def __init__(self) -> None:
        self.next_score = 0.0

    def score(self, chunk: ChunkSignals) -> torch.Tensor:
        return torch.full((chunk.num_tokens,), self.next_score)


def pixel_difference(frames: list[np.ndarray], previous: list[np.ndarray] | None) -> float:
    if previous is None:
        return 0.0
    return float(np.mean([np.abs(a.astype(np.int16) - b).mean()
                          for a, b in zip(frames, previous)]))


def stream_into(memory: StreamingMemory, chunks: list[tuple[list, list[float]]],
                pixel_diff: bool) -> None:
    """Add the chunks to memory; with pixel_diff under the pixel-difference baseline, whose
    score is set before each chunk."""
    baseline = PixelDiffPolicy()
    if pixel_diff:
        memory.policy = baseline
    previous = None
    for frames, times in chunks:
        baseline.next_score = pixel_difference(frames, previous)
        previous = frames
        memory.add_chunk(frames, times)


def event_chunks(events: list[dict], chunk_times: list[list[float]]) -> set[int]:
    """Chunks with a frame showing an event: an object on screen, or the first view of a cut."""
    found: set[int] = set()
    for event in events:
        for index, times in enumerate(chunk_times):
            if event["kind"] == "cut":
                if max(times) >= event["time"]:
                    found.add(index)
                    break
            elif any(event["time"] <= t < event["end"] for t in times):
                found.add(index)
    return found


def run_stream(loaded: LoadedModel, policy: str, chunks: list[tuple[list, list[float]]],
               budget: int, args: argparse.Namespace) -> set[int]:
    """The chunks that still have tokens in memory after the whole stream."""
    memory = StreamingMemory(loaded, memory_config(
        args, budget_tokens=budget, pixel_budget=args.pixel_budget, policy=engine_policy(policy),
        seed=args.seed))
    stream_into(memory, chunks, policy == PIXEL_DIFF)
    return set(memory.stats().retained_chunks)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seconds", type=float, default=120.0, help="stream length per seed")
    parser.add_argument("--event-every", type=float, default=8.0, help="seconds between events")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.15],
                        help="budgets as fractions of the stream's tokens")
    parser.add_argument("--window", type=int, default=64, help="recent window (tokens)")
    parser.add_argument("--pixel-budget", type=int, default=256 * 192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--policies", nargs="+", default=[*POLICY_NAMES, PIXEL_DIFF],
                        choices=[*POLICY_NAMES, PIXEL_DIFF])
    args, argv = parse(parser, argv)

    results = start_results("retention", argv)
    loaded = bench_model(args)
    builder = StreamingMemory(loaded, MemoryConfig(pixel_budget=args.pixel_budget)).builder
    # counts[policy][fraction] = [event chunks kept, event chunks, chunks kept, chunks]
    counts = {p: {f: [0, 0, 0, 0] for f in args.fractions} for p in args.policies}
    streams = []
    for seed in args.seeds:
        frames, events = synth_stream(args.seconds, FPS, args.width, args.height, seed,
                                      args.event_every)
        items = list(frames)
        chunks = [([items[i][1], items[i + 1][1]], [items[i][0], items[i + 1][0]])
                  for i in range(0, len(items) - 1, 2)]
        eventful = event_chunks(events, [times for _, times in chunks])
        tokens = sum(builder.build(f, t, 0).num_tokens for f, t in chunks)
        budgets = {f: max(round(f * tokens), args.window + 4) for f in args.fractions}
        streams.append({"seed": seed, "chunks": len(chunks), "events": len(events),
                        "event_chunks": len(eventful), "stream_tokens": tokens,
                        "budgets": budgets})
        for policy in args.policies:
            for fraction, budget in budgets.items():
                kept = run_stream(loaded, policy, chunks, budget, args)
                c = counts[policy][fraction]
                c[0] += len(kept & eventful)
                c[1] += len(eventful)
                c[2] += len(kept)
                c[3] += len(chunks)
    results |= {"model": describe_model(loaded), "streams": streams, "window": args.window,
                "pixel_budget": args.pixel_budget, "frame_size": [args.width, args.height],
                "fractions": args.fractions}
    results["policies"] = {
        policy: {str(f): {"event_chunks_kept": c[0], "event_chunks": c[1],
                          "event_fraction": c[0] / c[1], "chunks_kept": c[2], "chunks": c[3],
                          "chance": c[2] / c[3]}
                 for f, c in per_fraction.items()}
        for policy, per_fraction in counts.items()}
    title = (f"Retention of event chunks: {len(args.seeds)} synthetic streams x "
             f"{args.seconds:g} s, budgets {', '.join(percent(f) for f in args.fractions)} of "
             "the stream's tokens")
    return finish(args.out, results, title, report(results))


def report(results: dict[str, Any]) -> str:
    fractions = [str(f) for f in results["fractions"]]
    headers = ["policy"]
    for f in fractions:
        share = percent(float(f))
        headers += [f"events kept @ {share}", f"chance @ {share}", f"lift @ {share}"]
    rows = []
    for policy, per_fraction in results["policies"].items():
        row = [policy]
        for f in fractions:
            r = per_fraction[f]
            row += [f"{r['event_chunks_kept']}/{r['event_chunks']} "
                    f"({percent(r['event_fraction'])})", percent(r["chance"]),
                    f"{r['event_fraction'] / r['chance']:.2f}x"]
        rows.append(row)
    s = results["streams"]
    return md_table(headers, rows) + (
        f"\nStreams: seeds {[x['seed'] for x in s]}, {s[0]['chunks']} chunks each, "
        f"{sum(x['events'] for x in s)} events in {sum(x['event_chunks'] for x in s)} event "
        f"chunks, ~{s[0]['stream_tokens']} tokens per stream; window {results['window']} tokens, "
        "4 sinks, 4 buckets. Chance = the fraction of all chunks kept; lift = events kept / "
        "chance. Random weights: drift is at best a change detector here, so this tests the "
        "machinery, not the paper's claim; pixel_diff is the baseline any learned signal should "
        "beat.\n")


if __name__ == "__main__":
    main()
