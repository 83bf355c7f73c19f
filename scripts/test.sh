#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run every test: engine, node and tools over DDS, package, lint.
# Extra arguments go to pytest, e.g. scripts/test.sh -k policy
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# One torch thread per process: the node tests run the model in two processes at once, and on a
# 2-core machine oversubscribed threads make a tiny forward pass 10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest "$@"
