"""Bounded memory: one simulated hour of video through the engine, with the budget holding.

Why: a robot's memory must not grow with the length of the stream. The KV cache is bounded by the
budget M by construction, the Gated DeltaNet states have a fixed size, and the host process should
not creep either (no per-chunk leftovers: slot tables, chunk stamps, allocator growth). The one
counter that does grow is the position id: kept tokens keep their positions, new ones continue
from the running counter. When it nears max_position_embeddings (less MemoryConfig.compact_margin)
the engine compacts the retained slots' positions and the stream goes on; how often that happens
depends on the rate at which positions are used.

How: --chunks chunks (default 3,600: one hour at one chunk per second) of a synthetic stream
(synth_stream, 2 fps) at a small pixel budget through the model with a small budget. Every
--sample-every chunks: KV tokens, KV + state bytes (MemoryStats) and the process RSS (VmRSS of
/proc/self/status; on CUDA also torch.cuda.memory_allocated). RSS at start = right after the first
eviction (the cache is full); growth = end / start - 1 (target < 5 %). Positions: the counter at
the end vs max_position_embeddings, compactions during the run, the rate per stream second and
the hours until the first compaction at that rate, and the same for a chunk at the default 320x320
pixel budget (positions per chunk depend on the timestamp text, which this random model's
byte-level tokenizer spells with more tokens than Qwen's BPE would, so real compactions come
later).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltas_ros.core.chunks import ChunkBuilder
from deltas_ros.core.config import DEFAULT_PIXEL_BUDGET
from deltas_ros.core.memory import StreamingMemory

from .common import (
    finish,
    md_table,
    start_stream_run,
    stream_parser,
    synthetic_chunks,
    verdict,
)

MAX_RSS_GROWTH = 0.05


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size (VmRSS) of a process, this one by default, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def sample(memory: StreamingMemory, chunk: int) -> dict[str, Any]:
    gc.collect()
    stats = memory.stats()
    row = {"chunk": chunk, "kv_tokens": stats.kv_tokens,
           "memory_bytes": stats.kv_bytes + stats.state_bytes, "rss_bytes": rss_bytes()}
    if memory.device.type == "cuda":
        row["cuda_allocated_bytes"] = torch.cuda.memory_allocated(memory.device)
    return row


def default_budget_positions(memory: StreamingMemory, stream_s: float) -> int:
    """Positions one chunk advances at the default pixel budget, at stream time stream_s."""
    builder = ChunkBuilder.for_model(memory.model, memory.tokenizer, DEFAULT_PIXEL_BUDGET)
    frame = np.zeros((480, 640, 3), np.uint8)
    return builder.build([frame, frame], [stream_s, stream_s + 0.5], 0).next_position


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = stream_parser(__doc__, chunks=3600, chunks_help="chunks (1 s of video each)",
                           budget=256, window=64, pixel_budget=64 * 64, width=160, height=120)
    parser.add_argument("--sample-every", type=int, default=60, help="chunks between samples")
    args, results, memory = start_stream_run("bounded_memory", parser, argv)
    first_position = memory.next_position
    samples, start, max_kv = [], None, 0
    for frames, times in synthetic_chunks(args):
        result = memory.add_chunk(frames, times)
        max_kv = max(max_kv, result.kv_tokens)
        if start is None and result.evicted_tokens:
            start = sample(memory, result.index)
        if (result.index + 1) % args.sample_every == 0 or result.index + 1 == args.chunks:
            samples.append(sample(memory, result.index))
    if start is None:
        raise SystemExit("the cache never filled: lower --budget or raise --chunks")
    end = samples[-1]

    stats = memory.stats()
    rate = (stats.next_position - first_position) / args.chunks  # positions per stream second
    default_rate = default_budget_positions(memory, float(args.chunks))
    compact_at = stats.max_positions - memory.config.compact_margin
    results |= {
        "max_kv_tokens": max_kv, "start": start, "end": end, "samples": samples,
        "rss_growth": end["rss_bytes"] / start["rss_bytes"] - 1,
        "memory_bytes_max": max(s["memory_bytes"] for s in samples),
        "next_position": stats.next_position, "max_positions": stats.max_positions,
        "compactions": stats.compactions, "compact_at_position": compact_at,
        "positions_per_s": rate, "hours_to_compaction": compact_at / rate / 3600,
        "default_pixel_budget_positions_per_s": default_rate,
        "default_pixel_budget_hours_to_compaction": compact_at / default_rate / 3600,
    }
    if "cuda_allocated_bytes" in end:
        results["cuda_growth"] = end["cuda_allocated_bytes"] / start["cuda_allocated_bytes"] - 1
    return finish(args.out, results, title(results), report(results))


def title(results: dict[str, Any]) -> str:
    model = results["model"]
    return (f"Bounded memory: {results['chunks']} chunks ({results['chunks'] / 3600:.2f} h of "
            f"stream) through Qwen3.5 {model['source']} ({model['parameters'] / 1e6:.1f} M "
            f"parameters), {model['device']} {model['dtype']}, M = {results['budget']}")


def report(r: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        ["max KV tokens", r["max_kv_tokens"], f"<= {r['budget']}",
         verdict(r["max_kv_tokens"] <= r["budget"])],
        ["KV + state bytes, start -> end (max)",
         f"{r['start']['memory_bytes'] / mib:.2f} -> {r['end']['memory_bytes'] / mib:.2f} MiB "
         f"({r['memory_bytes_max'] / mib:.2f})", "flat",
         verdict(r["memory_bytes_max"] <= r["start"]["memory_bytes"])],
        ["process RSS, start (cache full, chunk "
         f"{r['start']['chunk']}) -> end",
         f"{r['start']['rss_bytes'] / mib:.1f} -> {r['end']['rss_bytes'] / mib:.1f} MiB "
         f"({100 * r['rss_growth']:+.2f} %)", "< +5 %",
         verdict(r["rss_growth"] < MAX_RSS_GROWTH)],
    ]
    if "cuda_growth" in r:
        rows.append(["CUDA memory allocated, start -> end",
                     f"{r['start']['cuda_allocated_bytes'] / mib:.1f} -> "
                     f"{r['end']['cuda_allocated_bytes'] / mib:.1f} MiB "
                     f"({100 * r['cuda_growth']:+.2f} %)", "< +5 %",
                     verdict(r["cuda_growth"] < MAX_RSS_GROWTH)])
    rows += [
        ["position counter at the end; compactions",
         f"{r['next_position']:,} of {r['max_positions']:,}; {r['compactions']}",
         "< max", verdict(r["next_position"] < r["max_positions"])],
        ["positions per stream second (this pixel budget)", f"{r['positions_per_s']:.1f}",
         "", f"first compaction after {r['hours_to_compaction']:.2f} h"],
        ["positions per stream second (320x320 budget, same stream time)",
         r["default_pixel_budget_positions_per_s"], "",
         f"first compaction after {r['default_pixel_budget_hours_to_compaction']:.2f} h"],
    ]
    body = md_table(["quantity", "measured", "target", "result"], rows)
    samples = r["samples"]
    picks = {s["chunk"]: s for s in samples[:: max(1, len(samples) // 6)] + samples[-1:]}
    trace = [[s["chunk"] + 1, s["kv_tokens"], f"{s['memory_bytes'] / mib:.3f}",
              f"{s['rss_bytes'] / mib:.1f}"] for s in picks.values()]
    body += "\nSampled over the stream:\n\n"
    body += md_table(["chunks", "KV tokens", "KV + state MiB", "RSS MiB"], trace)
    return body


if __name__ == "__main__":
    main()
