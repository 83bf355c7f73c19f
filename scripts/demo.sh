#!/usr/bin/env bash
# The main job, end to end on this machine:
#   set up -> a model (the shipped scene model unless MODEL=dir) -> a camera stream (a generated
#   scene bag unless BAG=dir) -> the memory node started as the launch file starts it -> the bag
#   replayed into it over DDS -> a planner's question (by default about the bag's first object)
#   -> the same bag run offline per policy at a small budget, asked the same -> a plot.
# Everything lands in $OUT (default out/demo). ROS_DOMAIN_ID defaults to 57.
# --dashboard: also serve the browser dashboard (docs/dashboard.md) beside the node, and keep
# both running after the demo until Ctrl-C; the robot's odometry for its map is made up
# (scripts/demo_poses.py: a lap of a room, in step with the camera).
set -euo pipefail
cd "$(dirname "$0")/.."
dashboard=false
for arg in "$@"; do
  case $arg in
    --dashboard) dashboard=true ;;
    *) echo "usage: $0 [--dashboard]" >&2; exit 2 ;;
  esac
done
scripts/setup.sh

out=${OUT:-out/demo}
mkdir -p "$out"
cli=.venv/bin/deltas-ros
bag=${BAG:-$out/stream}
# The node's defaults (budget 8192 tokens) hold this whole stream; the offline runs per policy
# below get a small budget (the shipped model's chunks are 14 tokens: ~14 tokens per second).
offline_args=(--budget "${BUDGET:-80}" --window 14 --sinks 6)

[ -d "$bag" ] || "$cli" synth "$bag" --scenes --duration 20 --fps 30 --width 640 --height 480
# By default, a question about the first object of the generated stream, and its true answer
# from the generator's events (the model never sees them; it answers from its memory).
mapfile -t default < <(.venv/bin/python -c "import json, os, sys
from deltas_ros.training.questions import answer_for, objects_of
events = json.load(open(sys.argv[1]))['events'] if os.path.isfile(sys.argv[1]) else None
objects = [e for e in objects_of(events) if 'shape' in e] if events is not None else []
if events is None:
    print('What appeared?')
    print('(unknown: no events.json beside the bag)')
elif objects:
    print(f\"What color was the {objects[0]['shape']}?\")
    print(answer_for('colour', events, shape=objects[0]['shape']))
else:
    print('What appeared?')
    print(answer_for('appeared', events))" "$bag/events.json")
question=${QUESTION:-${default[0]}}
truth=$([ -z "${QUESTION:-}" ] && echo "${default[1]}" || echo "(unknown for your question)")
model_args=()
if $dashboard; then model_args=(-p pose_topic:=/odom); fi
run_model=()
if [ -n "${MODEL:-}" ]; then
  model_args+=(-p model_path:="$(realpath "$MODEL")")
  run_model=(--model "$MODEL")
fi

export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-57} ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_LOG_DIR=$(realpath -m "$out")/ros_log
echo "== starting the memory node (log: $out/node.log)"
.venv/lib/deltas_ros/memory_node --ros-args -r __node:=deltas_memory \
  --params-file config/deltas.yaml -p reliable_qos:=true "${model_args[@]}" \
  > "$out/node.log" 2>&1 &
node=$!
dash=  # the dashboard's and demo_poses.py's process ids, with --dashboard
trap 'kill -INT $node $dash 2>/dev/null || true; wait $node $dash 2>/dev/null || true' EXIT
if $dashboard; then
  .venv/bin/python scripts/demo_poses.py > "$out/poses.log" 2>&1 &
  dash=$!
  "$cli" dashboard --port "${DASHBOARD_PORT:-8080}" > "$out/dashboard.log" 2>&1 &
  dash="$dash $!"
  echo "== dashboard: http://127.0.0.1:${DASHBOARD_PORT:-8080}/ (log: $out/dashboard.log)"
fi

echo "== replaying $bag into /camera/image_raw"
"$cli" replay "$bag" --wait 120 | tail -n 3
echo "== asking: $question"
"$cli" ask "$question" --wait-idle | tee "$out/answer.txt"
echo "== the stream's truth: $truth"

echo "== the same stream offline, per policy, at a budget of ${BUDGET:-80} tokens"
for policy in surprise deltas recency uniform; do
  echo "-- $policy"
  "$cli" run "$bag" "${run_model[@]}" --policy "$policy" "${offline_args[@]}" \
    --ask "$question" --quiet --out "$out/$policy.jsonl" | tail -n 4
done
"$cli" plot "$out"/{surprise,deltas,recency,uniform}.jsonl --out "$out/memory.png"
echo "== done: answer in $out/answer.txt, plot in $out/memory.png"
if $dashboard; then
  echo "== the node and the dashboard keep running at http://127.0.0.1:${DASHBOARD_PORT:-8080}/;" \
    "Ctrl-C stops both"
  wait "$node"
fi
