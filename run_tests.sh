#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
# A lint error fails the suite before a test runs (pyproject.toml: [tool.ruff]); a system python without ruff
# (NANOCHAT_SYSTEM_PYTHON=1, a GPU image) says so and runs the tests.
if command -v ruff >/dev/null; then ruff check --quiet .; else echo "run_tests: no ruff on PATH: lint skipped" >&2; fi
# Two workers (pytest-xdist), one per core: most tests wait on subprocesses (torchrun, the scripts) and leave
# a core idle, so the suite takes ~60% of its one-worker time. worksteal: a worker that runs out of tests takes
# some of the other's queue, rather than idling while the other ends the suite (the longest start first: conftest).
python -m pytest -q -n 2 --dist worksteal "$@"
