#!/usr/bin/env bash
# Install a Prometheus server (Debian's package, ~6 s) where none is on the PATH, for the test that scrapes Ray's
# metrics endpoint with a real Prometheus and queries it (tests/e2e/test_observability.py). Needs apt and root;
# elsewhere it says so and the test is skipped (or fails where MILES_RAY_REQUIRE names prometheus).
set -euo pipefail
command -v prometheus >/dev/null && exit 0
if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
  echo "setup_prometheus: no prometheus on PATH and no apt-get as root to install it" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
prometheus --version 2>&1 | head -1
