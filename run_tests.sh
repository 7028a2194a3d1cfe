#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
# Two workers (pytest-xdist), one per core: most tests wait on subprocesses (torchrun, the scripts) and leave
# a core idle, so the suite takes ~60% of its one-worker time. worksteal: a worker that runs out of tests takes
# some of the other's queue, rather than idling while the other ends the suite (the longest start first: conftest).
python -m pytest -q -n 2 --dist worksteal "$@"
