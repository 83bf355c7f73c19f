"""What the second tier costs: a chunk's time with tiering on against off, a 2-hour stream's
memory with the tiers at their budgets, and a question's time with an hour in the host tier.

Why: the second tier must not slow the camera's path (its writer is off the chunk's thread),
must stay within its budgets however long the robot runs, and a question that recalls from an
hour of stream must not cost much more than one that does not.

How, three parts in one run (each skipped with 0 for its length):
- chunks: two memories of a model of --config's dimensions in bfloat16 at M = --chunk-budget,
  tiering off and on (host tier), fed the same --chunks chunks of a synthetic stream, in
  alternating order; per chunk the engine's time
  (forward + signal + eviction, where the tier's gather and queueing are) and the wall time of
  add_chunk; medians after the first eviction, and their ratio.
- long: --long-chunks chunks (7200: two hours at a chunk a second) of the tiny model (M =
  --small-budget) through one memory with a host tier of --host-mb and a disk tier of
  --disk-mb; the RSS every --sample-every chunks, its growth from the first sample after the
  tiers filled to the end, and the disk tier's bytes on disk at each sample (at most
  --disk-mb).
- question: a model of --config's dimensions (default Qwen3.5-0.8B) in bfloat16 at M =
  --budget, filled by --fill-chunks chunks, then --tier-seconds of stream (an hour) in the host
  tier: random keys and values of the cache's layout, --chunk-tokens a chunk (what an hour of
  the stream evicts, without an hour of forwards on this CPU). --questions rounds, each asks
  with recall off, then at each --recall-tokens (default 1024 and M), over the same memory,
  without evidence; the medians, their ratio to recall off, and the chunks recalled
  (--every-layer: also scored by every full-attention layer's queries, from a whole prefill of
  the question over the GPU tier, asked in the same rounds; the tier then keeps every layer's
  key summaries, which both read). Then
  (--cold-disk) the same hour in a disk tier instead, each question read cold (the tier's files
  dropped from the page cache first, `posix_fadvise`): the figure from a cold disk.

    python -m bench.tier_costs --out bench/results
    python -m bench.tier_costs --smoke --out /tmp/tier_costs   # the tiny model, seconds (CI)

Honest limits: the question part's tier is synthetic (its scores say nothing of recall's
accuracy: bench.recall measures that); times are this CPU's, beside each other, not absolute.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from deltas_ros.core import memory as memory_module
from deltas_ros.core.asking import recall_chunks
from deltas_ros.core.memory import StreamingMemory
from deltas_ros.core.recall import summarizer
from deltas_ros.core.tiers import MB, TierPiece, TierStore

from .bounded_memory import rss_bytes
from .common import (
    bench_model,
    finish,
    md_table,
    median,
    memory_config,
    parse,
    start_results,
    synthetic_chunks,
    verdict,
)

DEFAULT_CONFIG = Path(__file__).parents[1] / "config" / "models" / "qwen3_5_0_8b.json"
QUESTION = "What did you see near the door?"
MAX_CHUNK_RATIO = 1.05  # a chunk's median time, tiering on over off
MAX_QUESTION_RATIO = 1.20  # a question's time with recall over without
MAX_GROWTH = 0.05  # RSS growth once the tiers are full
SMOKE = dict(config=None, chunks=40, chunk_budget=120, budget=120, window=24, pixel_budget=4096,
             width=160, height=120, long_chunks=300, host_mb=0.2, disk_mb=0.5, sample_every=50,
             fill_chunks=12, tier_seconds=300, chunk_tokens=14, questions=1, max_new_tokens=2,
             recall_tokens=[60, 0])


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def stream_args(args: argparse.Namespace, chunks: int, dtype: str = "auto",
                config: str | None = None) -> argparse.Namespace:
    """The options bench.common's model and stream helpers read, for one part of the run."""
    return argparse.Namespace(**{**vars(args), "chunks": chunks, "dtype": dtype,
                                 "config": config, "model": None, "device": "cpu"})


def chunk_part(args: argparse.Namespace) -> dict[str, Any]:
    """Tiering off and on side by side over the same chunks, at --config's dimensions in
    bfloat16 with M = --chunk-budget (so that evictions start after a few chunks)."""
    options = stream_args(args, args.chunks, "bfloat16", args.config)
    loaded = bench_model(options)
    base = memory_config(args, budget_tokens=args.chunk_budget,
                         window_tokens=args.chunk_budget // 8, pixel_budget=args.pixel_budget)
    memories = {"off": StreamingMemory(loaded, base),
                "on": StreamingMemory(loaded, replace(base, host_budget_mb=1024.0))}
    engine: dict[str, list[float]] = {"off": [], "on": []}
    wall: dict[str, list[float]] = {"off": [], "on": []}
    for k, (frames, times) in enumerate(synthetic_chunks(options)):
        for name in ("off", "on") if k % 2 else ("on", "off"):
            start = time.perf_counter()
            result = memories[name].add_chunk(frames, times)
            if result.evicted_tokens:
                wall[name].append((time.perf_counter() - start) * 1e3)
                engine[name].append(result.forward_ms + result.signal_ms + result.evict_ms)
    tiered = memories["on"].tiers.current_stats()
    memories["on"].close()
    row = {name: {"engine_ms": median(engine[name]), "wall_ms": median(wall[name]),
                  "chunks": len(engine[name])} for name in engine}
    row["engine_ratio"] = row["on"]["engine_ms"] / row["off"]["engine_ms"]
    row["wall_ratio"] = row["on"]["wall_ms"] / row["off"]["wall_ms"]
    row["tiered_chunks"] = tiered.host_chunks
    return row


def long_part(args: argparse.Namespace) -> dict[str, Any]:
    """A long stream into tiers at their budgets: RSS and disk bytes as it goes."""
    options = stream_args(args, args.long_chunks)
    loaded = bench_model(options)
    with tempfile.TemporaryDirectory(prefix="tiers-") as folder:
        memory = StreamingMemory(loaded, memory_config(
            args, pixel_budget=args.pixel_budget, host_budget_mb=args.host_mb,
            disk_budget_mb=args.disk_mb, tier_dir=folder))
        samples, full_at = [], None
        for k, (frames, times) in enumerate(synthetic_chunks(options)):
            memory.add_chunk(frames, times)
            if (k + 1) % args.sample_every and k + 1 != args.long_chunks:
                continue
            memory.tiers.flush(10.0)
            gc.collect()
            stats = memory.tiers.current_stats()
            on_disk = sum(f.stat().st_size for f in Path(folder).glob("chunk-*"))
            samples.append({"chunk": k, "rss_bytes": rss_bytes(), "disk_bytes": on_disk,
                            "disk_chunks": stats.disk_chunks,
                            "dropped_chunks": stats.dropped_chunks})
            if full_at is None and stats.dropped_chunks:
                full_at = len(samples) - 1
            progress(f"long: chunk {k + 1}/{args.long_chunks}, RSS "
                     f"{samples[-1]['rss_bytes'] / MB:.0f} MiB, disk {on_disk / MB:.2f} MiB")
        stats = memory.tiers.current_stats()
        memory.close()
    first = samples[full_at if full_at is not None else -1]
    return {"samples": samples, "full_at_chunk": first["chunk"],
            "rss_growth": samples[-1]["rss_bytes"] / first["rss_bytes"] - 1,
            "max_disk_bytes": max(s["disk_bytes"] for s in samples),
            "dropped_chunks": stats.dropped_chunks, "dropped_pieces": stats.dropped_pieces,
            "host_bytes": stats.host_bytes}


def fill_tier(memory: StreamingMemory, seconds: int, tokens: int, seed: int) -> None:
    """`seconds` chunks of `tokens` random K/V each, of the cache's layout, into the host
    tier, at positions inside the stream (so a question reads them before its own)."""
    keys = [t for name, t in memory.backend.export_tensors().items() if name.endswith(".keys")]
    layers, heads, dim, dtype = len(keys), keys[0].shape[1], keys[0].shape[3], keys[0].dtype
    g = torch.Generator().manual_seed(seed)
    first = int(memory.slots.position[0][memory.slots.chunk >= 0].min())
    for k in range(seconds):
        start = first + k * (memory.next_position - first - tokens) // max(1, seconds)
        position = torch.arange(start, start + tokens).expand(3, tokens).clone()
        piece = TierPiece(memory.chunks_seen + k, float(k),
                          torch.randn(layers, heads, tokens, dim, generator=g).to(dtype),
                          torch.randn(layers, heads, tokens, dim, generator=g).to(dtype),
                          position, torch.rand(tokens, generator=g))
        memory.tiers.put(piece)
        if k % 32 == 31:
            memory.tiers.flush(60.0)
    memory.tiers.flush(60.0)


def question_part(args: argparse.Namespace) -> dict[str, Any]:
    """Questions with recall off and at each --recall-tokens over an hour in the host tier."""
    options = stream_args(args, args.fill_chunks, "bfloat16", args.config)
    loaded = bench_model(options)
    sizes = [tokens or args.budget for tokens in args.recall_tokens]
    text = loaded.model.config.text_config
    per_token = 2 * 2 * text.layer_types.count("full_attention") * text.num_key_value_heads \
        * getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
    host_mb = 2 * args.tier_seconds * args.chunk_tokens * per_token / MB
    memory = StreamingMemory(loaded, memory_config(
        args, pixel_budget=args.pixel_budget, window_tokens=args.budget // 8,
        evidence_candidates=0, max_new_tokens=args.max_new_tokens,
        host_budget_mb=math.ceil(host_mb), recall_tokens=max(sizes)))
    if args.every_layer:
        memory.tiers.summarize = summarizer("top-norm", 1, every_layer=True)
    for k, (frames, times) in enumerate(synthetic_chunks(options)):
        result = memory.add_chunk(frames, times)
        progress(f"question: fill chunk {k + 1}/{args.fill_chunks}, KV {result.kv_tokens}")
    fill_tier(memory, args.tier_seconds, args.chunk_tokens, args.seed)
    stats = memory.tiers.current_stats()
    config = memory.config
    asked = [(0, False), *((tokens, every) for tokens in sizes
                           for every in (False, True)[:1 + args.every_layer])]
    times_ms: dict[tuple[int, bool], list[float]] = {key: [] for key in asked}
    recalled: dict[tuple[int, bool], list[int]] = {key: [] for key in asked}
    for _ in range(args.questions):
        for tokens, every in asked:
            memory.config = replace(config, recall_tokens=tokens)
            with mock.patch.object(memory_module, "recall_chunks",
                                   partial(recall_chunks, every_layer=every)):
                answer = memory.ask(QUESTION)
            times_ms[tokens, every].append(answer.latency_ms)
            recalled[tokens, every].append(answer.recalled_chunks)
            progress(f"question: recall_tokens {tokens}{', every layer' * every}: "
                     f"{answer.latency_ms:.0f} ms")
    cold = cold_disk(memory, args, sizes) if args.cold_disk else {}
    memory.close()
    off = median(times_ms[0, False])
    return {"kv_tokens": memory.kv_tokens, "tier_chunks": stats.host_chunks,
            "tier_bytes": stats.host_bytes, "off_ms": off, "rounds": list(times_ms.values()),
            "recall": [{"recall_tokens": tokens, "every_layer": every,
                        "ms": median(times_ms[tokens, every]),
                        "ratio": median(times_ms[tokens, every]) / off,
                        "recalled_chunks": median(recalled[tokens, every]),
                        **({} if every else cold.get(tokens, {}))}
                       for tokens, every in asked[1:]],
            "model": Path(args.config).name if args.config else "tiny"}


def cold_disk(memory: StreamingMemory, args: argparse.Namespace,
              sizes: list[int]) -> dict[int, dict[str, float]]:
    """The same hour in a disk tier instead (under --disk-dir), each question read cold: the
    tier's files dropped from the page cache first. Per recall size: its median ms and the
    chunks it read from disk."""
    host = memory.tiers
    with tempfile.TemporaryDirectory(prefix="tiers-", dir=args.disk_dir) as folder:
        memory.tiers = TierStore(0, 1 << 50, Path(folder))
        memory.tiers.rotate, memory.tiers.summarize = host.rotate, host.summarize
        try:
            fill_tier(memory, args.tier_seconds, args.chunk_tokens, args.seed)
            config, times = memory.config, {tokens: [] for tokens in sizes}
            from_disk = {tokens: [] for tokens in sizes}
            for _ in range(args.questions):
                for tokens in sizes:
                    drop_page_cache(Path(folder))
                    memory.config = replace(config, recall_tokens=tokens)
                    answer = memory.ask(QUESTION)
                    times[tokens].append(answer.latency_ms)
                    from_disk[tokens].append(answer.recalled_from_disk)
                    progress(f"question: recall_tokens {tokens}, cold disk: "
                             f"{answer.latency_ms:.0f} ms")
        finally:
            memory.tiers.close()
            memory.tiers, memory.config = host, config
    return {tokens: {"cold_disk_ms": median(times[tokens]),
                     "from_disk": median(from_disk[tokens])} for tokens in sizes}


def drop_page_cache(folder: Path) -> None:
    """Make reading the files in `folder` cold: written back, then dropped from the page
    cache (posix_fadvise; no root needed)."""
    os.sync()
    for path in folder.glob("chunk-*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="the question part's model dimensions (config.json-style file)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=40, help="chunks, tiering off and on")
    parser.add_argument("--chunk-budget", type=int, default=1024,
                        help="M of the chunk part")
    parser.add_argument("--budget", type=int, default=8192, help="M of the question part")
    parser.add_argument("--window", type=int, default=28, help="recent window (tokens)")
    parser.add_argument("--pixel-budget", type=int, default=320 * 320)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--small-budget", type=int, default=140,
                        help="M of the long part (the tiny model's ~14-token chunks)")
    parser.add_argument("--long-chunks", type=int, default=7200)
    parser.add_argument("--host-mb", type=float, default=2.0)
    parser.add_argument("--disk-mb", type=float, default=8.0)
    parser.add_argument("--sample-every", type=int, default=300)
    parser.add_argument("--fill-chunks", type=int, default=84,
                        help="chunks that fill M in the question part")
    parser.add_argument("--tier-seconds", type=int, default=3600)
    parser.add_argument("--chunk-tokens", type=int, default=104)
    parser.add_argument("--recall-tokens", type=int, nargs="+", default=[1024, 0],
                        help="recall sizes measured side by side (0: M)")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--every-layer", action="store_true",
                        help="also ask with recall scored by every full-attention layer's "
                        "queries")
    parser.add_argument("--cold-disk", action=argparse.BooleanOptionalAction, default=True,
                        help="also ask with the hour in a disk tier, read cold")
    parser.add_argument("--disk-dir", default=None,
                        help="where the cold disk tier is written (default: the temp dir)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, seconds (CI)")
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        parser.set_defaults(**SMOKE, small_budget=SMOKE["budget"])
    args, argv = parse(parser, argv)
    results = start_results("tier_costs", argv)
    small = argparse.Namespace(**{**vars(args), "budget": args.small_budget,
                                  "pixel_budget": 64 * 64, "width": 160, "height": 120})
    if args.smoke:
        small = args
    if args.chunks:
        results["chunks"] = chunk_part(args)
    if args.long_chunks:
        results["long"] = long_part(small)
    if args.questions:
        results["question"] = question_part(args)
    return finish(args.out, results, "The second tier's costs", report(results))


def report(r: dict[str, Any]) -> str:
    parts = [(chunks_report, "chunks"), (long_report, "long"), (question_report, "question")]
    return "\n".join(write(r[key]) for write, key in parts if key in r)


def chunks_report(c: dict[str, Any]) -> str:
    rows = [[n, f"{c[n]['engine_ms']:.2f}", f"{c[n]['wall_ms']:.2f}"] for n in ("off", "on")]
    rows.append(["on / off", f"{c['engine_ratio']:.3f}", f"{c['wall_ratio']:.3f}"])
    return (f"Chunk time, tiering off and on over the same chunks (medians after the first "
            f"eviction, ms):\n\n"
            f"{md_table(['', 'engine (forward + signal + eviction)', 'add_chunk wall'], rows)}"
            f"\n\n{verdict(c['wall_ratio'] <= MAX_CHUNK_RATIO)} (target <= {MAX_CHUNK_RATIO}x;"
            f" {c['tiered_chunks']} chunks tiered)\n")


def long_report(g: dict[str, Any]) -> str:
    return (f"A {g['samples'][-1]['chunk'] + 1}-chunk stream into the tiers: the tiers full "
            f"(first drop) at chunk {g['full_at_chunk'] + 1}; RSS growth from there to the end "
            f"{100 * g['rss_growth']:+.1f} % ({verdict(g['rss_growth'] <= MAX_GROWTH)}, target "
            f"<= {100 * MAX_GROWTH:.0f} %); the disk tier at most "
            f"{g['max_disk_bytes'] / MB:.2f} MiB on disk; {g['dropped_chunks']} chunks dropped "
            f"past both budgets, {g['dropped_pieces']} pieces the writer could not keep up "
            f"with.\n")


def question_report(q: dict[str, Any]) -> str:
    rows = [[f"{c['recall_tokens']}{' (every layer)' * c['every_layer']}", f"{c['ms']:.0f}",
             f"{c['ratio']:.2f}", c["recalled_chunks"],
             verdict(c["ratio"] <= MAX_QUESTION_RATIO),
             f"{c['cold_disk_ms']:.0f} ({c['from_disk']:.0f} read)" if "cold_disk_ms" in c
             else "-"] for c in q["recall"]]
    headers = ["recall_tokens", "ms (host tier)", "over recall off", "chunks recalled",
               f"target <= {MAX_QUESTION_RATIO}x", "ms from a cold disk tier"]
    return (f"A question over M = {q['kv_tokens']} tokens of {q['model']} in bfloat16 with "
            f"{q['tier_chunks']} chunks ({q['tier_bytes'] / 2**30:.2f} GiB) in the host tier, "
            f"without evidence; medians of {len(q['rounds'][0])} rounds, recall off "
            f"{q['off_ms']:.0f} ms:\n\n{md_table(headers, rows)}\n")


if __name__ == "__main__":
    main()
