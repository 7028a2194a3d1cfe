# Sourced by speedrun.sh and run_tests.sh: make ./.venv from requirements.txt when it is missing
# or older than requirements.txt, then put it first on PATH. NANOCHAT_SYSTEM_PYTHON=1 skips both and
# runs the python on PATH as it is (a GPU machine's preinstalled CUDA torch, no network: bench/run_gpu.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [ "${NANOCHAT_SYSTEM_PYTHON:-0}" != 1 ]; then
    if [ ! -x "$VENV/bin/python" ] || [ "$ROOT/requirements.txt" -nt "$VENV/.installed" ]; then
        echo "setup: creating $VENV from requirements.txt"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q -r "$ROOT/requirements.txt"
        touch "$VENV/.installed"
    fi
    export PATH="$VENV/bin:$PATH"
else
    for tool in python torchrun; do
        command -v "$tool" >/dev/null || { echo "setup: NANOCHAT_SYSTEM_PYTHON=1 but no $tool on PATH" >&2; exit 2; }
    done
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
