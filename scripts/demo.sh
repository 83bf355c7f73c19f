#!/usr/bin/env bash
# The main job, end to end on this machine:
#   set up -> a model (tiny random one unless MODEL=dir) -> a camera stream (a generated bag unless
#   BAG=dir) -> the memory node started as the launch file starts it -> the bag replayed into it
#   over DDS -> a planner's question -> the same bag run offline per policy -> a plot.
# Everything lands in $OUT (default out/demo). ROS_DOMAIN_ID defaults to 57.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

out=${OUT:-out/demo}
mkdir -p "$out"
cli=.venv/bin/deltas-ros
model=${MODEL:-$out/tiny-model}
bag=${BAG:-$out/stream}
question=${QUESTION:-"What happened in front of the camera?"}
# A small budget so that eviction happens within a 60 s demo stream (~100 tokens per second).
memory_args=(-p budget_tokens:="${BUDGET:-2048}" -p window_tokens:=512)

[ -f "$model/config.json" ] || "$cli" make-model --tiny "$model"
[ -d "$bag" ] || "$cli" synth "$bag" --duration 60 --fps 30 --width 640 --height 480

export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-57} ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_LOG_DIR=$PWD/$out/ros_log
echo "== starting the memory node (log: $out/node.log)"
.venv/lib/deltas_ros/memory_node --ros-args -r __node:=deltas_memory \
  --params-file config/deltas.yaml -p model_path:="$PWD/$model" -p reliable_qos:=true \
  "${memory_args[@]}" > "$out/node.log" 2>&1 &
node=$!
trap 'kill -INT $node 2>/dev/null || true; wait $node 2>/dev/null || true' EXIT

echo "== replaying $bag into /camera/image_raw"
"$cli" replay "$bag" --wait 120 | tail -n 3
echo "== asking: $question"
"$cli" ask "$question" --wait-idle | tee "$out/answer.txt"

echo "== the same stream offline, per policy"
for policy in deltas recency uniform; do
  "$cli" run "$bag" --model "$model" --policy "$policy" --budget "${BUDGET:-2048}" \
    --window 512 --quiet --out "$out/$policy.jsonl" | tail -n 1
done
"$cli" plot "$out"/deltas.jsonl "$out"/recency.jsonl "$out"/uniform.jsonl --out "$out/memory.png"
echo "== done: answer in $out/answer.txt, plot in $out/memory.png"
