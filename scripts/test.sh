#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run every test: engine, node and tools over DDS, package, lint.
# Extra arguments go to pytest, e.g. scripts/test.sh -k policy
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
