"""What the memory view costs the worker per chunk: ~/memory_image, ~/memory_chunks and
~/memory_markers side by side, at the numbers of held chunks a memory has.

Why: the node refreshes all three after every chunk, on the worker thread that runs the model;
the markers (one arrow per held chunk, labels, the path, an answer's evidence) must cost about
what the image does, not grow into the chunk's budget as the memory holds more chunks.

How: no model and no DDS graph: for each --held count, synthetic held chunks (poses along a
path, four temporal buckets, the newest tenth in the recent window) and a 640x480 frame; each
round is a chunk that comes while the oldest leaves, so the buckets shift. Per round, each
message is built as MemoryView.chunk_done builds it and serialized with rclpy's
serialize_message (the Python-to-C conversion a publish makes): the image is MemoryImage.add of
the frame, retain, render and image_message (at --thumbnails, the node's default 24); the chunk
list chunks_message; the markers memory_markers with a three-chunk answer's evidence and the
per-chunk markers kept from the round before, as the node keeps them. Medians over --rounds
rounds after one warm-up round, interleaved (one of each per round), on one thread.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np
from rclpy.serialization import serialize_message

from deltas_ros.core.poses import Pose
from deltas_ros.core.results import Answer, HeldChunk
from deltas_ros.ros.markers import ChunkMarkers, Evidence, memory_markers
from deltas_ros.ros.memory_io import chunks_message, image_message
from deltas_ros.runtime.image import MemoryImage

from .common import finish, md_table, median, parse, start_results


def poses(count: int) -> list[Pose]:
    """The robot's poses at chunks 0..count-1, along a circle of 10 m."""
    return [Pose("map", (10 * math.cos(0.05 * i), 10 * math.sin(0.05 * i), 0.0),
                 (0.0, 0.0, math.sin(0.025 * i), math.cos(0.025 * i))) for i in range(count)]


def held_chunks(at: list[Pose], count: int, first: int = 0) -> list[HeldChunk]:
    """`count` held chunks a second apart from chunk `first` at their poses `at` (the same
    objects each time, as the memory's slot table keeps them), four buckets, the newest tenth
    recent."""
    recent = max(1, count // 10)
    return [HeldChunk(i, float(i), 14, -1 if k >= count - recent else 4 * k // (count - recent),
                      at[i]) for k, i in enumerate(range(first, first + count))]


def evidence(held: list[HeldChunk]) -> Evidence:
    """A three-chunk answer's evidence over `held`."""
    picked = held[::max(1, len(held) // 3)][:3]
    return Evidence.of(Answer(
        text="The red toolbox was on the workbench by the door.",
        evidence_times=[h.time for h in picked], evidence_stamps=[None] * len(picked),
        evidence_poses=[h.pose for h in picked], memory_tokens=8192, span_start=0.0,
        span_end=held[-1].time, latency_ms=0.0, generated_tokens=12))


def measure(count: int, rounds: int, thumbnails: int) -> dict[str, Any]:
    """Median ms of building + serializing each message at `count` held chunks."""
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), np.uint8)
    at = poses(count + rounds + 1)
    answer, strip, kept = evidence(held_chunks(at, count)), MemoryImage(thumbnails), ChunkMarkers()
    for h in held_chunks(at, count - 1):
        strip.add(h.index, h.time, 0.1, frame)
    times: dict[str, list[float]] = {"image": [], "chunks": [], "markers": []}
    sizes: dict[str, int] = {}
    for round_ in range(rounds + 1):
        held = held_chunks(at, count, round_)  # the node's stats give it; not timed
        start = time.perf_counter()
        strip.add(held[-1].index, held[-1].time, 0.1, frame)
        strip.retain(h.index for h in held)
        data = serialize_message(image_message(strip.render(), 1.0, "camera"))
        times["image"].append(time.perf_counter() - start)
        sizes["image"] = len(data)
        start = time.perf_counter()
        data = serialize_message(chunks_message(held, 1.0, "camera"))
        times["chunks"].append(time.perf_counter() - start)
        sizes["chunks"] = len(data)
        start = time.perf_counter()
        array = memory_markers(held, answer, chunks=kept)
        data = serialize_message(array)
        times["markers"].append(time.perf_counter() - start)
        sizes["markers"], sizes["marker_count"] = len(data), len(array.markers)
    row = {f"{name}_ms": round(median(values[1:]) * 1e3, 3) for name, values in times.items()}
    return {"held": count, **row, **{f"{k}_bytes" if k != "marker_count" else k: v
                                     for k, v in sizes.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, nargs="+", default=[20, 84, 300, 1000],
                        help="numbers of held chunks (84: M = 8192 at 98 tokens a chunk)")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--thumbnails", type=int, default=24)
    args, argv = parse(parser, argv)
    results = start_results("memory_view", argv)
    rows = [measure(count, args.rounds, args.thumbnails) for count in args.held]
    results |= {"rounds": args.rounds, "thumbnails": args.thumbnails, "rows": rows}
    body = md_table(
        ["held chunks", "memory image ms", "memory chunks ms", "memory markers ms",
         "markers / image", "markers (count, bytes)", "image bytes"],
        [[r["held"], r["image_ms"], r["chunks_ms"], r["markers_ms"],
          f"{r['markers_ms'] / r['image_ms']:.2f}x",
          f"{r['marker_count']}, {r['markers_bytes']:,}", f"{r['image_bytes']:,}"]
         for r in rows])
    return finish(args.out, results, "What the memory view costs per chunk", body)


if __name__ == "__main__":
    main()
