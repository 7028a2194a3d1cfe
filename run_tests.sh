#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite (CPU, no downloads).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
python -m pytest -q "$@"
