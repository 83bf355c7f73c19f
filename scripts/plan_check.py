"""Check `deltas-ros plan` against the memory a CPU run really takes (docs/robot.md).

    deltas-ros make-model --config config/models/qwen3_5_0_8b.json /tmp/q08
    OMP_NUM_THREADS=1 .venv/bin/python scripts/plan_check.py --model /tmp/q08 --budget 2048

Streams generated 640x480 frames at 2 fps through `StreamingMemory` past M (so evictions run),
asks one question with the evidence search, and compares the peak resident memory the run
added to the process (peak RSS minus the RSS before the model was loaded: the interpreter and
libraries are not the plan's) with the plan's `peak_bytes`. Exit code 1 when they differ by
more than --tolerance. The weights are memory-mapped by the loader: they count in RSS once
touched, which the question's output layer does for the embedding matrix.

With --host-budget-mb and --recall-tokens the memory has a second tier, which the plan counts
on the CPU (host and device share one memory), and the question calls back --recall-tokens:
the stream then runs on until the host tier is full (its first drop), so that the tier holds
what the plan counts.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/plan_check.py --model /tmp/q08bf16 \
        --budget 2048 --dtype bfloat16 --host-budget-mb 64 --recall-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

from deltas_ros.core.loader import load_model
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.plan import PlanInputs, mib, plan_for_path
from deltas_ros.training.synth import synth_stream


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    """The most resident memory this process has held (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (random init is fine)")
    parser.add_argument("--budget", type=int, default=2048, help="M in tokens")
    parser.add_argument("--chunks", type=int, help="chunks to stream (default: M's worth + 10)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--host-budget-mb", type=float, default=0.0,
                        help="the second tier's host budget (0: no second tier)")
    parser.add_argument("--recall-tokens", type=int, default=0,
                        help="tokens the question calls back from the second tier")
    parser.add_argument("--max-chunks", type=int, default=1000,
                        help="the most chunks streamed while the host tier fills")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    tiered = args.host_budget_mb > 0
    inputs = PlanInputs(budget_tokens=args.budget,
                        recall_tokens=args.recall_tokens if tiered else 0,
                        host_tier_bytes=int(args.host_budget_mb * 2**20))
    plan = plan_for_path(args.model, inputs, torch.device("cpu"), dtype)
    chunks = args.chunks or args.budget // plan.tokens_per_chunk + 10
    most = max(chunks, args.max_chunks) if tiered else chunks
    # the frames of `chunks` chunks, shown again in turn while a host tier fills
    frames = [frame for _, frame in synth_stream(chunks, 2.0, *inputs.frame[::-1])[0]]
    baseline = rss_bytes()
    config = MemoryConfig(budget_tokens=args.budget, pixel_budget=inputs.pixel_budget,
                          max_new_tokens=inputs.answer_tokens,
                          evidence_candidates=inputs.evidence_candidates,
                          host_budget_mb=args.host_budget_mb,
                          recall_tokens=inputs.recall_tokens)
    started = time.perf_counter()
    memory = StreamingMemory(load_model(args.model, "cpu", args.dtype), config)
    results = []
    for i in range(most):
        k = 2 * (i % chunks)
        results.append(memory.add_chunk(frames[k:k + 2], [i, i + 0.5]))
        if i + 1 >= chunks and not (tiered and _tier_open(memory)):
            break
    streamed = rss_bytes()
    answer = memory.ask("What was on the table, and when did it appear?")
    added = peak_rss_bytes() - baseline
    tier = memory.tiers.current_stats() if tiered else None
    figures = {
        "model": args.model, "dtype": args.dtype, "budget_tokens": args.budget,
        "chunks": len(results), "eviction_events": sum(r.evicted_tokens > 0 for r in results),
        "host_budget_mb": args.host_budget_mb, "recall_tokens": config.recall_tokens,
        "tier_host_bytes": tier and tier.host_bytes,
        "recalled_chunks": answer.recalled_chunks,
        "kv_tokens": memory.kv_tokens, "chunk_tokens": results[-1].chunk_tokens,
        "answer_tokens": answer.generated_tokens, "evidence": answer.evidence_times,
        "wall_s": round(time.perf_counter() - started, 1),
        "rss_before_model": baseline, "rss_after_stream": streamed,
        "rss_after_question": rss_bytes(), "peak_rss": baseline + added,
        "peak_added": added, "plan_error": plan.peak_bytes / added - 1, "plan": plan.to_json(),
    }
    memory.close()
    print(json.dumps(figures, indent=2) if args.out is None else f"wrote {args.out}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    print(f"plan peak {mib(plan.peak_bytes)} vs measured {mib(added)} above the process's "
          f"{mib(baseline)} before the model: {figures['plan_error']:+.1%} "
          f"(tolerance {args.tolerance:.0%})")
    return 0 if abs(figures["plan_error"]) <= args.tolerance else 1


def _tier_open(memory: StreamingMemory) -> bool:
    """Whether the host tier has room left: nothing dropped past its budget yet."""
    memory.tiers.flush(timeout=60.0)
    return memory.tiers.current_stats().dropped_chunks == 0


if __name__ == "__main__":
    sys.exit(main())
