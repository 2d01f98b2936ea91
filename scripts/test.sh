#!/usr/bin/env bash
# Install (scripts/setup.sh; setup_vllm.sh and setup_sglang.sh for the vLLM and SGLang engine tests) and run the
# whole test suite: ruff, unit tests, then real-Ray end-to-end tests (one real vLLM and one real SGLang server;
# a Prometheus server from Debian's package, scripts/setup_prometheus.sh).
set -euo pipefail
. "$(dirname "$0")/env.sh"
bash scripts/setup_vllm.sh
bash scripts/setup_sglang.sh
bash scripts/setup_prometheus.sh
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/miles_ray_ray}"
# installed above: a broken one fails, not skips
export MILES_RAY_REQUIRE="${MILES_RAY_REQUIRE-vllm,sglang,megatron,prometheus}"
ruff check src tests benchmarks examples
ruff format --check src tests benchmarks examples
python -m pytest -q tests "$@"
