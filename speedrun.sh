#!/usr/bin/env bash
# The pipeline, one torchrun call per stage. Every artifact goes to $NANOCHAT_BASE_DIR; a stage whose
# output exists is skipped (FORCE=1 re-runs it) and an interrupted stage resumes from its last
# checkpoint, so re-running after a crash picks up where it stopped.
#
#   bash speedrun.sh                                                  # demo: synthetic data, tiny model
#   BACKBONE=/path/ckpt PAIRS=/path/pairs.jsonl [PROMPTS=...] [TOKENIZER=...] bash speedrun.sh
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
NPROC_PER_NODE="${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}"
FORCE="${FORCE:-0}"
RM_STEPS="${RM_STEPS:-150}"
GRPO_STEPS="${GRPO_STEPS:-40}"
t0=$SECONDS

run() { torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" -m "$@"; }
done_in() { ls "$1"/meta_*.json >/dev/null 2>&1; }
# stage NAME DIR CMD...: skip when DIR holds a final checkpoint, resume when it holds a partial one.
stage() {
    local name=$1 dir=$2; shift 2
    if [ "$FORCE" != 1 ] && [ -f "$dir/.complete" ]; then
        echo "== stage $name: skipped ($dir is complete)"; return
    fi
    local resume=()
    [ "$FORCE" != 1 ] && ls "$dir"/state_*.pt >/dev/null 2>&1 && resume=(--resume latest)
    echo "== stage $name ($NPROC_PER_NODE ranks)"
    local s=$SECONDS
    run "$@" --out "$dir" "${resume[@]}"
    touch "$dir/.complete"
    echo "== stage $name: $((SECONDS - s)) s"
}

if [ -z "${BACKBONE:-}" ] || [ -z "${PAIRS:-}" ]; then
    BACKBONE="$NANOCHAT_BASE_DIR/base_checkpoints/demo"
    TOKENIZER="$NANOCHAT_BASE_DIR/tokenizer"
    PAIRS="$NANOCHAT_BASE_DIR/demo/pairs.jsonl"
    PROMPTS="$NANOCHAT_BASE_DIR/demo/prompts.jsonl"
    if [ "$FORCE" = 1 ] || [ ! -f "$PROMPTS" ] || ! done_in "$BACKBONE"; then
        echo "== stage demo_data"
        python -m scripts.kat_demo_data
    else
        echo "== stage demo_data: skipped (exists)"
    fi
fi
PROMPTS="${PROMPTS:-$PAIRS}"
TOK=()
[ -n "${TOKENIZER:-}" ] && TOK=(--tokenizer "$TOKENIZER")

RM_DIR="$NANOCHAT_BASE_DIR/rm_checkpoints/uniform"
GRPO_DIR="$NANOCHAT_BASE_DIR/grpo_checkpoints/uniform"
stage reward_model "$RM_DIR" scripts.kat_train_rm -- --backbone "$BACKBONE" "${TOK[@]}" --pairs "$PAIRS" \
    --max_steps "$RM_STEPS" --batch_size 32 --unfreeze_last 1 --save_every 50
stage grpo "$GRPO_DIR" scripts.kat_train_grpo -- --policy "$BACKBONE" "${TOK[@]}" --rm "$RM_DIR" \
    --prompts "$PROMPTS" --max_steps "$GRPO_STEPS" --batch_size 8 --group_size 8 --max_new_tokens 16 \
    --lr 3e-3 --beta 0.01 --eval_every 20 --save_every 20

echo "== done in $((SECONDS - t0)) s; artifacts in $NANOCHAT_BASE_DIR"
python - "$RM_DIR" "$GRPO_DIR" <<'PY'
import json, sys
from nanochat_ext.checkpoint import find_checkpoint
for d in sys.argv[1:]:
    model, meta = find_checkpoint(d)
    m = json.loads(meta.read_text())["metrics"]
    print(f"{model}\n  " + ", ".join(f"{k} {v:.3f}" for k, v in m.items() if k.startswith(("val/", "eval/"))))
PY
