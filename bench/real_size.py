"""Real size: a random-init model of a released Qwen3.5's dimensions (default 0.8B) through the
engine at the real pixel budget and M = 8192, on this machine, in float32 and bfloat16.

Why: every other table runs the tiny test model; the product runs Qwen3.5 0.8B to 9B with
~100-token chunks and M = 8192. This measures what those sizes cost here: whether the chunk
forward keeps up with a 2 fps camera (real-time factor), the signal's and the eviction's share
of it, whether the process stays flat once M is reached, and what a question costs with and
without evidence, with the node's evidence candidates and with 32, on the evidence search's old
path (one forward per candidate, each over a copy of the K/V without the chunk:
`asking_reference.leave_one_out`) and the path questions use (the candidates as rows of batched
forwards over the cache as it is: `leave_one_out_batched`), and what ranking the candidates
costs (`asking.estimated_drops`: one forward and backward).

How, per --dtypes (one model in memory at a time): the model is built in memory by
`common.bench_model`, the steps of `deltas-ros make-model --config`
(test/bench/test_scripts checks it equals make_model + load_model); --chunks chunks of a
synthetic stream (synth_stream, 2 fps, two frames a chunk) through one StreamingMemory; per chunk
the engine's own timings (ChunkResult);
the process RSS every --sample-every chunks, growth from the first eviction to the end. Then
--questions rounds, each: `ask` without evidence (evidence_candidates 0) and with it, with
--candidates (the node's default) and --full-candidates (32) side by side; the estimate alone;
and the two searches alone on the same question, answer and --full-candidates held chunks
(evenly spread over the memory), old then new; each alone with its peak RSS above the RSS
before it (VmHWM reset through /proc/self/clear_refs), the searches' drops compared. "Question
with evidence, old path" is the question without evidence plus the old search, both measured
in the same round. Last, every --policies signal side by side on the
same full memory (DeltaS, the state surprise and the paper's baselines: what each costs per
chunk and per eviction event at this size, `signals_side_by_side`). --smoke: the tiny model, a
few chunks (CI).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltas_ros.core.asking import by_drop, estimated_drops, leave_one_out_batched
from deltas_ros.core.asking_reference import leave_one_out
from deltas_ros.core.evidence_forward import (
    EVIDENCE_BATCH_BYTES,
    evidence_batch_bytes,
    evidence_rows,
    gate_pass_bytes,
)
from deltas_ros.core.loader import LoadedModel
from deltas_ros.core.memory import MemoryConfig, StreamingMemory
from deltas_ros.core.policy import POLICY_NAMES, make_policy
from deltas_ros.core.signals import state_surprise, write_strength

from .bounded_memory import rss_bytes
from .common import (
    add_stream_args,
    bench_model,
    describe_model,
    finish,
    md_table,
    median,
    parse,
    percent,
    start_results,
    stream_settings,
    verdict,
)
from .engine_overhead import (
    Frames,
    PolicyRun,
    against_deltas,
    stream_chunks,
    time_recordings,
)

DEFAULT_CONFIG = Path(__file__).parents[1] / "config" / "models" / "qwen3_5_0_8b.json"
QUESTION = "Where is the cup?"
ANSWER = " The cup is on the table by the window, next to the red box."
TARGET_QUESTION_S = 10.0  # a question with evidence at the 0.8B dimensions on this CPU
MIN_EVENTS = 50
# DeltaS, the state surprise and the paper's baselines (bench.engine_overhead times them all
# on the tiny model).
SIDE_BY_SIDE = ("deltas", "surprise", "deltas_surprise", "infinipot_v", "streammem",
                "beta_error")
MAX_SIGNAL_FRACTION = 0.01  # a state signal's share of the chunk forward at 0.8B
STATE_SIGNALS = ("deltas", "surprise", "deltas_surprise")
MAX_GROWTH = 0.05
SMOKE = dict(config=None, chunks=12, budget=120, window=40, pixel_budget=4096, width=160,
             height=120, sample_every=4, questions=1, candidates=2, full_candidates=4,
             max_new_tokens=2,
             min_events=1, policy_chunks=2)


def peak_rss(work: Callable[[], Any]) -> tuple[Any, int | None]:
    """work() and the process's peak RSS during it above its RSS before it, in bytes (None
    where the kernel does not let the peak be reset)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return work(), None
    before = rss_bytes()
    result = work()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return result, int(line.split()[1]) * 1024 - before
    return result, None


def progress(line: str) -> None:
    """A line on stderr: a real-size run takes many minutes."""
    print(line, file=sys.stderr, flush=True)


def stream(memory: StreamingMemory, chunks: Frames, args: argparse.Namespace) -> dict[str, Any]:
    """The chunks through the memory: the engine's timings and the RSS samples."""
    results, samples, start = [], [], None
    for frames, times in chunks:
        result = memory.add_chunk(frames, times)
        results.append(result)
        index = result.index
        if start is None and result.evicted_tokens:
            gc.collect()
            start = {"chunk": index, "rss_bytes": rss_bytes()}
        if (index + 1) % args.sample_every == 0 or index + 1 == args.chunks:
            gc.collect()
            samples.append({"chunk": index, "kv_tokens": memory.kv_tokens,
                            "rss_bytes": rss_bytes()})
            progress(f"{memory.loaded.dtype}: chunk {index + 1}/{args.chunks}, KV "
                     f"{memory.kv_tokens}, forward {result.forward_ms:.0f} ms")
    evictions = [r.evict_ms for r in results if r.evicted_tokens]
    forward = median([r.forward_ms for r in results])
    row = {
        "chunk_tokens": median([r.chunk_tokens for r in results]),
        "forward_ms": forward, "signal_ms": median([r.signal_ms for r in results]),
        "evict_ms_per_event": median(evictions), "eviction_events": len(evictions),
        "max_kv_tokens": max(r.kv_tokens for r in results),
        "chunk_ms": median([r.forward_ms + r.signal_ms + r.evict_ms for r in results]),
        "first_eviction": start, "samples": samples,
    }
    row["signal_fraction"] = row["signal_ms"] / forward
    row["evict_fraction"] = row["evict_ms_per_event"] / forward
    row["real_time_factor"] = forward / 1000.0  # a chunk is 1 s of stream
    if start is not None:
        row["rss_growth"] = samples[-1]["rss_bytes"] / start["rss_bytes"] - 1
    return row


def spread(chunks: list[int], count: int) -> list[int]:
    """`count` of `chunks`, evenly spaced (all of them when there are fewer)."""
    if len(chunks) <= count:
        return chunks
    return [chunks[round(i * (len(chunks) - 1) / (count - 1))] for i in range(count)]


def question_round(memory: StreamingMemory, args: argparse.Namespace) -> dict[str, Any]:
    """One round: ask without evidence, with --candidates and with --full-candidates; then the
    estimate alone and the two searches alone, old then new."""
    config = memory.config
    timings: dict[str, Any] = {}
    for name, candidates in (("ask_ms", 0), ("ask_evidence_ms", args.candidates),
                             ("ask_evidence_full_ms", args.full_candidates)):
        memory.config = replace(config, evidence_candidates=candidates)
        answer = memory.ask(QUESTION, args.max_new_tokens)
        timings[name], timings["generated_tokens"] = answer.latency_ms, answer.generated_tokens
        progress(f"{name} {answer.latency_ms:.0f}")
    memory.config = config
    backend, slots = memory.backend, memory.slots
    ids = memory.layout.question_ids(memory.tokenizer, QUESTION)
    answer_ids = memory.tokenizer.encode(ANSWER, add_special_tokens=False)
    answer_ids = answer_ids[:max(1, timings["generated_tokens"])]
    candidates = spread(slots.retained_chunks(), args.full_candidates)
    kv_before = memory.kv_tokens
    with torch.inference_mode():
        snapshot = backend.snapshot()
        searches = {
            "estimate": lambda: estimated_drops(backend, slots, ids, answer_ids,
                                                memory.next_position, None),
            "old": lambda: leave_one_out(backend, slots, ids, answer_ids, memory.next_position,
                                         candidates, None, lambda: backend.restore(snapshot),
                                         math.inf),
            "new": lambda: leave_one_out_batched(backend, slots, ids, answer_ids,
                                                 memory.next_position, candidates, None,
                                                 math.inf),
        }
        drops = {}
        for name, search in searches.items():
            gc.collect()
            start = time.perf_counter()
            drops[name], timings[f"{name}_peak_rss_bytes"] = peak_rss(search)
            timings[f"{name}_search_ms"] = (time.perf_counter() - start) * 1e3
            progress(f"{name} search {timings[f'{name}_search_ms']:.0f} ms")
    if memory.kv_tokens != kv_before:
        raise RuntimeError("an evidence search left the cache changed")
    tokens = len(ids) + len(answer_ids)
    text, dtype = memory.model.config.text_config, backend.dtype
    rows = evidence_rows(EVIDENCE_BATCH_BYTES, text, kv_before, tokens, len(answer_ids), dtype,
                         len(candidates) + 1)
    timings |= {
        "question_tokens": len(ids), "answer_tokens": len(answer_ids),
        "candidates": len(candidates), "kv_tokens": kv_before, "rows_per_batch": rows,
        "batches": math.ceil((len(candidates) + 1) / rows),
        "batch_bytes_estimate": evidence_batch_bytes(text, rows, kv_before, tokens,
                                                     len(answer_ids), dtype),
        "estimate_bytes_estimate": gate_pass_bytes(text, kv_before, tokens, len(answer_ids),
                                                   dtype, backend.device.type),
        "max_drop_difference": max((abs(drops["old"][c] - drops["new"][c])
                                    for c in candidates), default=0.0),
        "same_ranking": by_drop(candidates, drops["old"]) == by_drop(candidates, drops["new"]),
        "same_evidence": (by_drop(candidates, drops["old"])[:config.evidence_chunks]
                          == by_drop(candidates, drops["new"])[:config.evidence_chunks]),
    }
    timings["ask_evidence_old_ms"] = timings["ask_ms"] + timings["old_search_ms"]
    timings["ask_candidates"], timings["ask_full_candidates"] = (args.candidates,
                                                                 args.full_candidates)
    return timings


def signals_side_by_side(memory: StreamingMemory, chunks: Frames,
                         args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every --policies signal at this size, in one run: on the same memory, full at M after
    the stream, --policy-chunks further chunks under each policy in turn (only the policy is
    swapped), its own signal and each eviction event timed as bench.engine_overhead times
    them. Slots kept from before keep the scores they were given."""
    replays: list[float] = []
    time_recordings(memory, replays)
    rows = {}
    for k, policy in enumerate(args.policies):
        memory.policy = make_policy(policy)
        run = PolicyRun(memory, replays)
        for frames, times in chunks[k * args.policy_chunks:(k + 1) * args.policy_chunks]:
            run.add(frames, times, measured=True)
        rows[policy] = run.row()
        progress(f"{memory.loaded.dtype}: {policy} signal {rows[policy]['policy_signal_ms']:.1f}"
                 f" ms, eviction {rows[policy]['evict_ms_per_event']:.1f} ms / event")
    memory.backend.strength_fn, memory.backend.surprise_fn = write_strength, state_surprise
    return against_deltas(rows)


def run_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """The stream, the questions and the signals side by side on a fresh model of `dtype`;
    the model freed after."""
    loaded: LoadedModel = bench_model(argparse.Namespace(
        model=None, config=args.config, device="cpu", dtype=dtype, seed=args.seed))
    memory = StreamingMemory(loaded, MemoryConfig(
        budget_tokens=args.budget, window_tokens=args.window, pixel_budget=args.pixel_budget,
        max_new_tokens=args.max_new_tokens, evidence_candidates=args.candidates,
        max_question_s=3600.0))
    chunks = stream_chunks(args.chunks, args.width, args.height, args.seed)
    row = {"model": describe_model(loaded), **stream(memory, chunks, args)}
    row["rounds"] = [question_round(memory, args) for _ in range(args.questions)]
    if row["rounds"]:
        for key in ("ask_ms", "ask_evidence_ms", "ask_evidence_full_ms", "ask_evidence_old_ms",
                    "estimate_search_ms", "old_search_ms", "new_search_ms"):
            row[key] = median([r[key] for r in row["rounds"]])
        row["search_speedup"] = row["old_search_ms"] / row["new_search_ms"]
    more = stream_chunks(args.chunks + len(args.policies) * args.policy_chunks, args.width,
                         args.height, args.seed)[args.chunks:]  # stream times go on
    row["signals"] = signals_side_by_side(memory, more, args)
    del memory, loaded
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="config.json-style file of the model's dimensions")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    add_stream_args(parser, chunks=140, chunks_help="chunks (1 s of video each)", budget=8192,
                    window=1024, pixel_budget=320 * 320, width=640, height=480,
                    pixel_help="pixels a frame (320x320: ~100 visual tokens a chunk)")
    parser.add_argument("--sample-every", type=int, default=10, help="chunks between samples")
    parser.add_argument("--questions", type=int, default=2, help="question rounds (0: none)")
    parser.add_argument("--candidates", type=int, default=MemoryConfig.evidence_candidates,
                        help="evidence candidates (default: the node's)")
    parser.add_argument("--full-candidates", type=int, default=32,
                        help="evidence candidates timed beside them, and of the searches alone")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--policies", nargs="+", default=list(SIDE_BY_SIDE),
                        choices=POLICY_NAMES, help="signals timed side by side after the stream")
    parser.add_argument("--policy-chunks", type=int, default=4,
                        help="chunks under each of --policies")
    parser.add_argument("--min-events", type=int, default=MIN_EVENTS,
                        help="eviction events the stream must reach")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model and a few chunks: seconds, for CI")
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        parser.set_defaults(**SMOKE)
    args, argv = parse(parser, argv)

    results = start_results("real_size", argv)
    results |= {"config": args.config, **stream_settings(args), "question": QUESTION,
                "batch_bytes": EVIDENCE_BATCH_BYTES, "min_events": args.min_events,
                "dtypes": {dtype: run_dtype(args, dtype) for dtype in args.dtypes}}
    results["checks"] = checks(results)
    return finish(args.out, results, title(results), report(results))


def title(r: dict[str, Any]) -> str:
    model = next(iter(r["dtypes"].values()))["model"]
    return (f"Real size: Qwen3.5 {Path(model['source']).name} ({model['parameters'] / 1e9:.2f} B "
            f"parameters, random init), CPU, M = {r['budget']}, {r['chunks']} chunks")


def checks(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each dtype's figures against the targets (the question's only at the 0.8B dimensions)."""
    at_0_8b = r["config"] is not None and Path(r["config"]).resolve() == DEFAULT_CONFIG.resolve()
    rows = []
    for dtype, d in r["dtypes"].items():
        growth = d.get("rss_growth", math.nan)
        rows += [
            [f"{dtype}: eviction events", d["eviction_events"], f">= {r['min_events']}",
             verdict(d["eviction_events"] >= r["min_events"])],
            [f"{dtype}: max KV tokens", d["max_kv_tokens"], f"<= {r['budget']}",
             verdict(d["max_kv_tokens"] <= r["budget"])],
            [f"{dtype}: RSS, first eviction -> end", f"{100 * growth:+.2f} %", "< +5 %",
             verdict(growth < MAX_GROWTH)],
            [f"{dtype}: real-time factor (forward / 1 s of stream)",
             f"{d['real_time_factor']:.2f}", "< 1 keeps up with 2 fps",
             verdict(d["real_time_factor"] < 1)],
        ]
        rows += [[f"{dtype}: {policy} signal, share of the forward",
                  percent(s["signal_fraction"]), f"<= {percent(MAX_SIGNAL_FRACTION)} at 0.8B",
                  verdict(s["signal_fraction"] <= MAX_SIGNAL_FRACTION) if at_0_8b
                  else "n/a (not the 0.8B config)"]
                 for policy, s in d["signals"].items() if policy in STATE_SIGNALS]
        if not d["rounds"]:
            continue
        same = all(q["same_evidence"] for q in d["rounds"])
        rows += [
            [f"{dtype}: question with evidence ({d['rounds'][0]['ask_candidates']} candidates)",
             f"{d['ask_evidence_ms'] / 1e3:.1f} s", f"<= {TARGET_QUESTION_S:.0f} s at 0.8B",
             verdict(d["ask_evidence_ms"] <= TARGET_QUESTION_S * 1e3) if at_0_8b
             else "n/a (not the 0.8B config)"],
            [f"{dtype}: evidence, batched vs old",
             f"max |drop difference| "
             f"{max(q['max_drop_difference'] for q in d['rounds']):.2g}; same evidence: {same}",
             "same evidence", verdict(same)],
        ]
    return [dict(zip(("check", "measured", "target", "result"), row)) for row in rows]


def report(r: dict[str, Any]) -> str:
    mib, rows = 2**20, []
    for dtype, d in r["dtypes"].items():
        first = d["first_eviction"] or {"chunk": "-", "rss_bytes": float("nan")}
        rows.append([dtype, f"{d['chunk_tokens']:.0f}", f"{d['forward_ms']:.0f}",
                     f"{d['real_time_factor']:.2f}",
                     f"{d['signal_ms']:.2f} ({percent(d['signal_fraction'])})",
                     f"{d['evict_ms_per_event']:.2f} ({percent(d['evict_fraction'])})",
                     d["eviction_events"], d["max_kv_tokens"],
                     f"{first['rss_bytes'] / mib:.0f} -> {d['samples'][-1]['rss_bytes'] / mib:.0f}"
                     f" ({100 * d.get('rss_growth', math.nan):+.2f} %)"])
    body = md_table(["dtype", "tokens / chunk", "forward ms", "real-time factor",
                     "signal ms (of forward)", "eviction ms / event (of forward)", "events",
                     "max KV", "RSS MiB, first eviction -> end"], rows)
    asks, questions = [], []
    for dtype, d in r["dtypes"].items():
        for q in d["rounds"]:
            old_peak, new_peak, estimate_peak = (q[f"{p}_peak_rss_bytes"]
                                                 for p in ("old", "new", "estimate"))
            asks.append([
                dtype, f"{q['question_tokens']} + {q['answer_tokens']}", q["kv_tokens"],
                f"{q['ask_ms'] / 1e3:.1f}",
                f"{q['ask_evidence_ms'] / 1e3:.1f} ({q['ask_candidates']})",
                f"{q['ask_evidence_full_ms'] / 1e3:.1f} ({q['ask_full_candidates']})",
                f"{q['ask_evidence_full_ms'] / q['ask_evidence_ms']:.2f}x",
                f"{q['estimate_search_ms'] / 1e3:.1f}",
                "n/a" if estimate_peak is None else f"{estimate_peak / mib:.0f}",
                f"{q['estimate_bytes_estimate'] / mib:.0f}"])
            questions.append([
                dtype, f"{q['ask_evidence_old_ms'] / 1e3:.1f}", q["candidates"],
                f"{q['old_search_ms'] / 1e3:.1f}", f"{q['new_search_ms'] / 1e3:.1f}",
                f"{q['old_search_ms'] / q['new_search_ms']:.1f}x",
                f"{q['rows_per_batch']} x {q['batches']}",
                "n/a" if old_peak is None else f"{old_peak / mib:.0f}",
                "n/a" if new_peak is None else f"{new_peak / mib:.0f}",
                f"{q['batch_bytes_estimate'] / mib:.0f}", f"{q['max_drop_difference']:.2g}",
                q["same_ranking"]])
    signals = [[dtype, policy, f"{s['policy_signal_ms']:.2f}", percent(s["signal_fraction"]),
                f"{s.get('signal_x_deltas', math.nan):.1f}x", f"{s['evict_ms_per_event']:.2f}",
                percent(s["evict_fraction"]), f"{s.get('evict_x_deltas', math.nan):.1f}x",
                s["eviction_events"]]
               for dtype, d in r["dtypes"].items() for policy, s in d["signals"].items()]
    body += ("\nEvery signal side by side, after the stream, on the same memory at M (each "
             "policy's own chunks; medians):\n\n" + md_table(
                 ["dtype", "policy", "signal ms / chunk", "of forward", "x deltas",
                  "eviction ms / event", "of forward", "x deltas", "events"], signals))
    body += "\n" + (not asks and "No question rounds (--questions 0).\n" or md_table(
        ["dtype", "question + answer tokens", "KV", "ask s (no evidence)",
         "ask s, evidence (candidates)", "ask s, evidence (full candidates)", "full / node's",
         "estimate s", "estimate peak RSS MiB", "estimate plan MiB"], asks)
        + "\nThe searches alone, on the same answer:\n\n" + md_table(
        ["dtype", "ask s (evidence, old: no evidence + old search)",
         "candidates", "old search s", "batched search s", "speed-up", "rows x batches",
         "old search peak RSS MiB", "batched peak RSS MiB", "batch estimate MiB",
         "max |drop difference|", "same ranking"], questions))
    body += "\n" + md_table(["check", "measured", "target", "result"],
                           [list(check.values()) for check in r["checks"]])
    body += (f"\nStream: synth_stream {r['frame_size'][0]}x{r['frame_size'][1]} at 2 fps, two "
             f"frames a chunk, pixel budget {r['pixel_budget']}, window {r['window']} tokens; "
             f"question {r['question']!r}; the evidence batch bound "
             f"{r['batch_bytes'] / mib:.0f} MiB. Random weights: times and memory, not "
             f"answers. The tokenizer is byte-level (one token a character), so the question "
             f"has more tokens than Qwen's own tokenizer would give it.\n")
    return body


if __name__ == "__main__":
    main()
