#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole test suite: ruff, unit tests, then real-Ray end-to-end tests.
set -euo pipefail
. "$(dirname "$0")/env.sh"
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/miles_ray_ray}"
ruff check src tests benchmarks examples
python -m pytest -q tests "$@"
