#!/usr/bin/env bash
# Prepare what the GPU check carries to the lent GPU machine (#20), into .gpu/ (git-ignored), here where PyPI is
# reachable: the wheels that machine lacks (pydantic and its parts, xxhash, megatron-core; Python 3.12, manylinux,
# the versions this project's .venv runs) and SmolLM2's tokenizer files (its weights are too large to carry; the
# check makes random models with this tokenizer). About 6 MiB in all; the 64 MiB a call may carry holds it easily.
# Usage: bash benchmarks/gpu_wheels.sh          then the device tool's run with carry [".gpu"] (see docs/gpu.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tokenizer
pins=$("$PY" - <<'PYEOF'
import importlib.metadata as m
names = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "xxhash"]
print(" ".join(f"{n}=={m.version(n)}" for n in names), "megatron-core==0.19.2")
PYEOF
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do platforms+=(--platform "$p"); done
# shellcheck disable=SC2086  # $pins is a list of requirements
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .gpu/wheels $pins
"$PY" - <<'PYEOF'
from transformers import AutoTokenizer

from miles_ray.models.hub import smollm2_135m_dir

AutoTokenizer.from_pretrained(smollm2_135m_dir()).save_pretrained(".gpu/tokenizer")
PYEOF
du -sh .gpu
ls .gpu/wheels
