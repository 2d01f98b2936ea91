# Sourced by the scripts: install (setup.sh), enter the venv, keep caches and Ray's auth inside the project.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. .venv/bin/activate
export RAY_AUTH_MODE=disabled
export MILES_RAY_CACHE_DIR="${MILES_RAY_CACHE_DIR:-$PWD/.cache/miles_ray}"
