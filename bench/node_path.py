"""The node's engine path over a long stream: chunk forward, DeltaS signal, eviction and a question
now and then, with the device memory sampled to show it stays flat.

Why: the per-operation timings of engine_overhead do not show what a long run does to the
device's memory (allocator growth, per-chunk leftovers, a question's transient) nor the cost of
the whole path the node's worker runs (StreamingMemory.add_chunk and ask, as the worker calls
them). bench/gpu.sh runs it at Qwen3.5-9B dimensions in bf16 with the fla kernels; its CPU smoke
mode (SMOKE=1) runs it on the tiny model so the script cannot rot (test/bench/test_scripts).

How: --chunks chunks of a synthetic stream (synth_stream, 2 fps, 2 frames a chunk) through one
StreamingMemory; every --ask-every chunks a question (--max-new-tokens). Per chunk the engine's
own timings (ChunkResult: forward, signal, eviction); per question its latency. Every
--sample-every chunks: KV tokens, CUDA allocated bytes and peak since the last sample (on CUDA),
the process RSS. Flatness: allocated (CUDA) or RSS (CPU) at the end / at the first eviction - 1,
and the largest peak after the first eviction / the first window's peak - 1.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from deltas_ros.core.memory import StreamingMemory

from .bounded_memory import rss_bytes
from .common import (
    finish,
    md_table,
    median,
    percentile,
    start_stream_run,
    stream_parser,
    synthetic_chunks,
    verdict,
)

MAX_GROWTH = 0.05
TARGETS_MS = {"signal": 0.2, "evict": 1.0}  # H200, 9B bf16, M = 8192
QUESTION = "What was on the table a minute ago?"


def sample(memory: StreamingMemory, chunk: int) -> dict[str, Any]:
    row = {"chunk": chunk, "kv_tokens": memory.kv_tokens, "rss_bytes": rss_bytes()}
    if memory.device.type == "cuda":
        row["cuda_allocated_bytes"] = torch.cuda.memory_allocated(memory.device)
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(memory.device)
        torch.cuda.reset_peak_memory_stats(memory.device)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = stream_parser(__doc__, chunks=400, chunks_help="chunks (1 s of video each)",
                           budget=8192, window=1024, pixel_budget=320 * 320, width=640,
                           height=480)
    parser.add_argument("--ask-every", type=int, default=50, help="chunks between questions")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=20, help="chunks between samples")
    args, results, memory = start_stream_run("node_path", parser, argv)
    cuda = memory.device.type == "cuda"
    chunks, questions, samples, start = [], [], [], None
    for frames, times in synthetic_chunks(args):
        result = memory.add_chunk(frames, times)
        chunks.append(result)
        if start is None and result.evicted_tokens:
            start = sample(memory, result.index)
        if (result.index + 1) % args.ask_every == 0:
            t0 = time.perf_counter()
            answer = memory.ask(QUESTION, args.max_new_tokens)
            questions.append({"chunk": result.index, "latency_ms": answer.latency_ms,
                              "wall_ms": (time.perf_counter() - t0) * 1e3,
                              "tokens": answer.generated_tokens})
        if (result.index + 1) % args.sample_every == 0 or result.index + 1 == args.chunks:
            samples.append(sample(memory, result.index))
    if start is None:
        raise SystemExit("the cache never filled: lower --budget or raise --chunks")
    evictions = [r.evict_ms for r in chunks if r.evicted_tokens]
    after = [s for s in samples if s["chunk"] > start["chunk"]] or samples[-1:]
    key = "cuda_allocated_bytes" if cuda else "rss_bytes"
    results |= {
        "forward_ms": median([r.forward_ms for r in chunks]),
        "signal_ms": median([r.signal_ms for r in chunks]),
        "signal_ms_p99": percentile([r.signal_ms for r in chunks], 99),
        "evict_ms_per_event": median(evictions), "eviction_events": len(evictions),
        "question_ms": median([q["latency_ms"] for q in questions]),
        "questions": questions, "max_kv_tokens": max(r.kv_tokens for r in chunks),
        "start": start, "end": samples[-1], "samples": samples, "flatness_of": key,
        "growth": samples[-1][key] / start[key] - 1,
    }
    if cuda:
        results["peak_growth"] = (max(s["cuda_peak_bytes"] for s in after)
                                  / samples[0]["cuda_peak_bytes"] - 1)
    return finish(args.out, results, title(results), report(results, cuda))


def title(r: dict[str, Any]) -> str:
    m = r["model"]
    return (f"Node path: Qwen3.5 {m['source']} ({m['parameters'] / 1e6:.1f} M parameters), "
            f"{m['device']} {m['dtype']}, {m['gated_delta_kernels']} kernels, M = {r['budget']}, "
            f"{r['chunks']} chunks, {len(r['questions'])} questions")


def report(r: dict[str, Any], cuda: bool) -> str:
    mib = 2**20
    body = md_table(["forward ms", "signal ms (median / p99)", "eviction ms / event", "events",
                     "question ms", "questions", "max KV"],
                    [[f"{r['forward_ms']:.2f}", f"{r['signal_ms']:.3f} / "
                      f"{r['signal_ms_p99']:.3f}", f"{r['evict_ms_per_event']:.3f}",
                      r["eviction_events"], f"{r['question_ms']:.1f}", len(r["questions"]),
                      r["max_kv_tokens"]]])
    label = "CUDA allocated" if cuda else "process RSS (CPU smoke: not a GPU figure)"
    first, last = (r[at][r["flatness_of"]] / mib for at in ("start", "end"))
    checks = [[f"{label}: end / first eviction",
               f"{first:.1f} -> {last:.1f} MiB ({100 * r['growth']:+.2f} %)", "< +5 %",
               verdict(r["growth"] < MAX_GROWTH)]]
    if cuda:
        checks.append(["CUDA peak after the first eviction / first window's peak",
                       f"{100 * r['peak_growth']:+.2f} %", "< +5 %",
                       verdict(r["peak_growth"] < MAX_GROWTH)])
    for name, value in (("signal", r["signal_ms"]), ("evict", r["evict_ms_per_event"])):
        applies = cuda and r["budget"] == 8192
        checks.append([f"{name} (median)", f"{value:.3f} ms",
                       f"<= {TARGETS_MS[name]} ms on an H200, 9B bf16, M=8192",
                       verdict(value <= TARGETS_MS[name]) if applies else "n/a (not that run)"])
    return body + "\n" + md_table(["check", "measured", "target", "result"], checks)


if __name__ == "__main__":
    main()
