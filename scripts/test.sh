#!/usr/bin/env bash
# Install (scripts/setup.sh; setup_vllm.sh and setup_sglang.sh for the vLLM and SGLang engine tests) and run the
# whole test suite: ruff, unit tests, then real-Ray end-to-end tests (one real vLLM and one real SGLang server;
# a Prometheus server from Debian's package, scripts/setup_prometheus.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# the engines' venvs are independent of .venv, so they are built beside it, not after it (~5 and ~2 min on a fresh
# machine, each one pip process mostly waiting on downloads and disk)
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT # a failed install stops the others
bash scripts/setup_vllm.sh > "$logs/vllm.log" 2>&1 &
vllm=$!
bash scripts/setup_sglang.sh > "$logs/sglang.log" 2>&1 &
sglang=$!
. scripts/env.sh
bash scripts/setup_prometheus.sh
finished() { # name pid: wait for that setup and show its output; its failure ends this script
  wait "$2" || { cat "$logs/$1.log" >&2; echo "scripts/setup_$1.sh failed (its output above)" >&2; exit 1; }
  cat "$logs/$1.log"
}
finished vllm "$vllm"
finished sglang "$sglang"
rm -rf "$logs"
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/miles_ray_ray}"
# installed above: a broken one fails, not skips
export MILES_RAY_REQUIRE="${MILES_RAY_REQUIRE-vllm,sglang,megatron,prometheus}"
ruff check src tests benchmarks examples
ruff format --check src tests benchmarks examples
# the slowest tests listed at the end: the suite must stay well inside CI's time limit
python -m pytest -q --durations=20 tests "$@"
