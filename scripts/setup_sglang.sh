#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23 from PyPI beside the project's pinned CPU torch, for the SGLang rollout engine
# and its tests. The engine actor runs in the main .venv and starts the server with this interpreter
# (SGLangEngineConfig.python). SGLang's own requirements pin a CUDA torch and CUDA-only kernels (flashinfer,
# sglang-kernel, ...), so it is installed with --no-deps plus the pure-Python packages its server imports
# (scripts/sglang-requirements.txt: what `python -m sglang.launch_server` needs for a Llama model on CPU, measured).
# sgl_kernel and torchvision's operators are covered at run time by src/miles_ray/engines/sglang_site (CPU only).
# ~2 min and ~1.6 GB on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SHIM="PYTHONPATH=src/miles_ray/engines/sglang_site SGLANG_USE_CPU_ENGINE=1"  # the CPU shim the engine applies
if [ -x .venv-sglang/bin/python ] && env $SHIM .venv-sglang/bin/python -c "import sglang.srt.entrypoints.http_server" 2>/dev/null; then
  exit 0
fi
[ -x .venv-sglang/bin/python ] || "$PY" -m venv .venv-sglang
P=.venv-sglang/bin/python
$P -m pip install -q --upgrade pip
$P -m pip install -q "torch==2.13.0"
# every package pinned (pip freeze of the measured environment), installed without resolving SGLang's CUDA deps
$P -m pip install -q --no-deps -r scripts/sglang-requirements.txt
env $SHIM $P -c "import torch, sglang.srt.entrypoints.http_server; assert torch.__version__.startswith('2.13.0')"
