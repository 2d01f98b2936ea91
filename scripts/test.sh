#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole test suite: unit tests, then real-Ray end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export RAY_AUTH_MODE=disabled
# model conversions and Ray's temp files stay inside the project, never in the home folder
export MILES_RAY_CACHE_DIR="${MILES_RAY_CACHE_DIR:-$PWD/.cache/miles_ray}"
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/miles_ray_ray}"
ruff check src tests benchmarks examples
python -m pytest -q tests "$@"
