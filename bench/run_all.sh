#!/usr/bin/env bash
# Reproduce every table of bench/README.md on this machine's CPU: each benchmark writes its JSON and
# markdown into $OUT (default bench/results/), then all tables are gathered into $OUT/all.md.
# 6-8 minutes on 2 cores without real_size, which at the 0.8B dimensions takes far longer (its
# full run was not made yet; see README, Performance, Real size).
#
# THREADS (default 1) becomes OMP_NUM_THREADS for every process, the node included: on a 2-core
# machine shared with other jobs, two OpenMP threads per process spin against each other and the
# tiny model's forward gets 10x slower. Set THREADS=2 on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${THREADS:-1}
out=${OUT:-bench/results}
logs=$(mktemp -d)
benchmarks=(engine_overhead node_path bounded_memory ingest end_to_end retention real_size)
for name in "${benchmarks[@]}"; do
  start=$SECONDS
  .venv/bin/python -m "bench.$name" --out "$out" > "$logs/$name.log" 2>&1 \
    || { tail -30 "$logs/$name.log"; echo "bench.$name failed (log: $logs)" >&2; exit 1; }
  echo "bench.$name: $((SECONDS - start)) s"
done
for name in "${benchmarks[@]}"; do cat "$out/$name.md"; echo; done > "$out/all.md"
rm -r "$logs"
echo "all tables: $out/all.md ($SECONDS s in all)"
