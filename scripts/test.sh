#!/usr/bin/env bash
# Install (scripts/setup.sh, and scripts/setup_vllm.sh for the vLLM engine tests) and run the whole test suite:
# ruff, unit tests, then real-Ray end-to-end tests (the vLLM ones start one real vLLM server).
set -euo pipefail
. "$(dirname "$0")/env.sh"
bash scripts/setup_vllm.sh
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/miles_ray_ray}"
ruff check src tests benchmarks examples
python -m pytest -q tests "$@"
