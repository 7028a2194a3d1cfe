#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
# Two workers (pytest-xdist), one per core: most tests wait on subprocesses (torchrun, the scripts) and leave
# a core idle, so the suite takes ~60% of its one-worker time.
python -m pytest -q -n 2 "$@"
