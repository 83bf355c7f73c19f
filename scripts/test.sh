#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run every test: engine, node and tools over DDS, package, lint.
# Extra arguments go to pytest, e.g. scripts/test.sh -k policy
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# One torch thread per process: the node tests run the model in two processes at once, and on a
# 2-core machine oversubscribed threads make a tiny forward pass 10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two pytest-xdist workers, a test file each at a time (a module's node process is started
# once): most tests wait on DDS or on processes, so two halve the wall time on 2 cores. Each
# worker has its own ROS domain ids (conftest.py). `-n 0` after it runs in this process (-s).
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
