#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the quick-start GRPO job on the embedded engine (CPU is fine).
set -euo pipefail
. "$(dirname "$0")/env.sh"
python examples/quickstart.py "$@"
