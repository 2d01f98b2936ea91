#!/usr/bin/env bash
# GPU check (#20), on the lent GPU machine as it is: its own python3 (torch with CUDA, transformers), the missing
# pure-Python packages from the wheels carried in .gpu/ (made here by benchmarks/gpu_wheels.sh), no Ray, no network.
# Prints one table (benchmarks/gpu_check.py) and writes its JSON to $OUT (the device tool's folder) if set.
# Usage (on the GPU machine, from the repository root): bash benchmarks/gpu_check.sh [gpu_check.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .gpu/wheels ] || { echo "no .gpu/wheels: run bash benchmarks/gpu_wheels.sh here first and carry .gpu" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_site \
  .gpu/wheels/*.whl
export PYTHONPATH="/tmp/gpu_site:$PWD/src:$PWD" PYTHONUNBUFFERED=1 MILES_RAY_CACHE_DIR=/tmp/miles_ray_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m benchmarks.gpu_check --device cuda --tokenizer .gpu/tokenizer --out "${OUT:-benchmarks/results}" "$@"
