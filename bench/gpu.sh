#!/usr/bin/env bash
# One-shot GPU run of the engine overhead, the node path (chunk forward + signal + eviction + a
# question over a long stream, GPU memory sampled) and bounded memory, at Qwen3.5-9B dimensions,
# bf16, on CUDA with the fla kernels. Prepared for a CUDA machine; results, nvidia-smi and the
# package versions go to $OUT (default bench/results/gpu). Run from anywhere:
#
#     OUT=/some/dir bench/gpu.sh
#
# SMOKE=1: the same steps on the CPU with the tiny config and a few chunks (seconds;
# test/bench/test_scripts runs it so this script cannot rot). $PYTHON, if set, is the
# interpreter to use.
#
# Python: this checkout's .venv, else python3, if either imports the requirements with CUDA;
# otherwise a fresh venv ($VENV, default /tmp/deltas-bench-venv) gets the pinned packages the two
# benchmarks need from requirements.txt (no ROS packages: neither benchmark uses rclpy).
#
# The model: a random-init model of config/models/qwen3_5_9b.json ($CONFIG), built in each
# benchmark's process directly on the GPU in bf16 by the same steps as
#     deltas-ros make-model --config $CONFIG --dtype bfloat16 DIR
# (seed, fp32 construction, cast, decay init), which saves writing and re-reading 19 GB.
# Estimated (not measured) run time on an H200: about 5 minutes (two model builds, ~2.5 min of
# engine streaming, ~1 min of bounded streaming). Sizes: ENGINE_CHUNKS (110: the cache fills at
# ~79 chunks of 104 tokens, so ~30 eviction events per policy), NODE_CHUNKS (400, a question
# every 50), BOUNDED_CHUNKS (300).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/gpu}
config=${CONFIG:-config/models/qwen3_5_9b.json}
mkdir -p "$out"
start=$SECONDS

smoke=${SMOKE:-0}
need='import torch, torchvision, transformers, cv2, rosbags, transformers.models.qwen3_5'
[ "$smoke" = 1 ] || need+=$'\nassert torch.cuda.is_available(), "no CUDA device"\nimport fla.ops.gated_delta_rule'
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
  "$py" -c "$need"
elif [ -x .venv/bin/python ] && .venv/bin/python -c "$need" 2>/dev/null; then
  py=.venv/bin/python
elif command -v python3 > /dev/null && python3 -c "$need" 2>/dev/null; then
  py=python3
else
  venv=${VENV:-/tmp/deltas-bench-venv}
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  cp requirements-core.txt "$out/requirements-gpu.txt"  # no ROS: neither benchmark uses rclpy
  grep -o 'flash-linear-attention==[0-9.]*' setup.py >> "$out/requirements-gpu.txt"  # CUDA extra
  "$venv/bin/python" -m pip install --quiet -r "$out/requirements-gpu.txt"
  py=$venv/bin/python
  "$py" -c "$need"
fi
echo "python: $py ($((SECONDS - start)) s)"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
"$py" -m pip freeze > "$out/pip-freeze.txt" 2>/dev/null || true

if [ "$smoke" = 1 ]; then  # tiny model, CPU, a few chunks: the steps, not the figures
  common=(--device cpu --budget 120 --window 40 --out "$out")
  stream=(--pixel-budget 4096 --width 160 --height 120)
  engine=(--chunks 8 --warmup 1 --micro-budget 2048 --micro-reps 1 --policies deltas
          "${stream[@]}")
  node=(--chunks 10 --ask-every 5 --max-new-tokens 2 --sample-every 5 "${stream[@]}")
  bounded=(--chunks 10 --sample-every 5 "${stream[@]}")
else
  common=(--config "$config" --device cuda --dtype bfloat16 --budget 8192 --window 1024
          --out "$out")
  engine=(--chunks "${ENGINE_CHUNKS:-110}" --warmup 3 --micro-budget 8192 --micro-reps 20)
  node=(--chunks "${NODE_CHUNKS:-400}" --ask-every 50 --max-new-tokens 16 --sample-every 20)
  bounded=(--chunks "${BOUNDED_CHUNKS:-300}" --pixel-budget 102400 --width 640 --height 480
           --sample-every 20)
fi
"$py" -m bench.engine_overhead "${common[@]}" "${engine[@]}"
echo "engine_overhead done ($((SECONDS - start)) s)"
"$py" -m bench.node_path "${common[@]}" "${node[@]}"
echo "node_path done ($((SECONDS - start)) s)"
"$py" -m bench.bounded_memory "${common[@]}" "${bounded[@]}"
echo "bounded_memory done ($((SECONDS - start)) s); results in $out"
