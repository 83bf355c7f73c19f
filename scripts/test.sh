#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run every test: engine, node and tools over DDS, package, lint.
# Extra arguments go to pytest, e.g. scripts/test.sh -k policy
# `--distro jazzy` before them runs the tests on ROS 2 Jazzy (.venv-jazzy) instead of Kilted, e.g.
# scripts/test.sh --distro jazzy -m ros
set -euo pipefail
cd "$(dirname "$0")/.."
distro=kilted
case "${1-}" in
  --distro) distro=${2-}; shift $(($# < 2 ? $# : 2)) ;;
  --distro=*) distro=${1#--distro=}; shift ;;
esac
scripts/setup.sh --distro "$distro"
venv=.venv
[ "$distro" = kilted ] || venv=.venv-$distro
# One torch thread per process: the node tests run the model in two processes at once, and on a
# 2-core machine oversubscribed threads make a tiny forward pass 10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two pytest-xdist workers, a test file each at a time (a module's node process is started
# once): most tests wait on DDS or on processes, so two halve the wall time on 2 cores. Each
# worker has its own ROS domain ids (conftest.py). `-n 0` after it runs in this process (-s).
exec "$venv/bin/python" -m pytest -n 2 --dist loadfile "$@"
