#!/usr/bin/env bash
# The pipeline, one torchrun call per stage. Every artifact goes to $NANOCHAT_BASE_DIR; a stage whose
# output exists is skipped (FORCE=1 re-runs it), so an interrupted run picks up where it stopped.
#
#   bash speedrun.sh                                   # demo: synthetic data, tiny model, CPU or GPU
#   BACKBONE=/path/ckpt PAIRS=/path/pairs.jsonl bash speedrun.sh   # your model and data
#
# Stages today: demo data (only without BACKBONE/PAIRS) -> reward model. GRPO and the evaluation
# report will follow as their own stages.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
NPROC_PER_NODE="${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}"
FORCE="${FORCE:-0}"
RM_STEPS="${RM_STEPS:-150}"
run() { torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" -m "$@"; }
have_checkpoint() { ls "$1"/meta_*.json >/dev/null 2>&1; }
t0=$SECONDS

if [ -z "${BACKBONE:-}" ] || [ -z "${PAIRS:-}" ]; then
    BACKBONE="$NANOCHAT_BASE_DIR/base_checkpoints/demo"
    TOKENIZER="$NANOCHAT_BASE_DIR/tokenizer"
    PAIRS="$NANOCHAT_BASE_DIR/demo/pairs.jsonl"
    if [ "$FORCE" = 1 ] || [ ! -f "$PAIRS" ] || ! have_checkpoint "$BACKBONE"; then
        echo "== stage demo_data"
        python -m scripts.kat_demo_data
    else
        echo "== stage demo_data: skipped (exists)"
    fi
fi
TOKENIZER_ARGS=()
[ -n "${TOKENIZER:-}" ] && TOKENIZER_ARGS=(--tokenizer "$TOKENIZER")

RM_DIR="$NANOCHAT_BASE_DIR/rm_checkpoints/uniform"
if [ "$FORCE" = 1 ] || ! have_checkpoint "$RM_DIR"; then
    echo "== stage reward_model ($NPROC_PER_NODE ranks)"
    RESUME=()
    [ "$FORCE" != 1 ] && ls "$RM_DIR"/state_*.pt >/dev/null 2>&1 && RESUME=(--resume latest)
    run scripts.kat_train_rm -- --backbone "$BACKBONE" "${TOKENIZER_ARGS[@]}" --pairs "$PAIRS" \
        --out "$RM_DIR" --max_steps "$RM_STEPS" --batch_size 32 --unfreeze_last 1 --save_every 50 "${RESUME[@]}"
else
    echo "== stage reward_model: skipped (exists in $RM_DIR)"
fi

echo "== done in $((SECONDS - t0)) s; artifacts in $NANOCHAT_BASE_DIR"
python - <<PY
import json, pathlib
from nanochat_ext.checkpoint import find_checkpoint
model, meta = find_checkpoint("$RM_DIR")
m = json.loads(meta.read_text())["metrics"]
print(f"reward model: {model}")
print("  " + ", ".join(f"{k} {v:.3f}" for k, v in m.items() if k.startswith("val/")))
PY
