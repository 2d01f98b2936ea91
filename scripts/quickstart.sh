#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the quick-start GRPO job on the embedded engine (CPU is fine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export RAY_AUTH_MODE=disabled
export MILES_RAY_CACHE_DIR="${MILES_RAY_CACHE_DIR:-$PWD/.cache/miles_ray}"
python examples/quickstart.py "$@"
