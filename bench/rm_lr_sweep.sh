#!/usr/bin/env bash
# The reward model's learning rate against what it trains (#66): SmolLM2-135M-Instruct's RM on word-arithmetic pairs
# (the right number chosen, a near miss rejected), held-out pair accuracy and loss after STEPS steps for each lr and
# each of --unfreeze_last 0 (the head), 2 (the last two blocks) and all. One JSON line per run into $OUT.
#
#   MODEL_DIR=~/.cache/nanochat/models/smollm2-135m-instruct bash bench/rm_lr_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
MODEL_DIR="${MODEL_DIR:?the converted SmolLM2 dir (MODEL=smollm2 bash speedrun.sh makes it)}"
WORK="${WORK:-$(mktemp -d)}"
OUT="${OUT:-bench/results/rm_lr_sweep_$(date +%F).jsonl}"
STEPS="${STEPS:-30}"  # the recorded sweep (bench/results/rm_lr_sweep_2026-11-27.jsonl)
BATCH="${BATCH:-8}"
[ -f "$WORK/task/pairs.jsonl" ] || python -m scripts.kat_task_data --task word_arithmetic --out "$WORK/task" --n_train 800
sweep() {  # mode lr...
    local mode="$1"; shift
    for lr in "$@"; do
        local run="$WORK/rm_${mode}_${lr}"
        python -m scripts.kat_train_rm --backbone "$MODEL_DIR" --pairs "$WORK/task/pairs.jsonl" --unfreeze_last "$mode" \
            --lr "$lr" --max_steps "$STEPS" --batch_size "$BATCH" --eval_every 0 --log_every 10 --save_every 0 \
            --out "$run" > "$run.log" 2>&1 || { echo "failed: $mode $lr (log $run.log)"; continue; }
        python - "$run" "$mode" "$lr" "$STEPS" "$BATCH" >> "$OUT" <<'PY'
import json, sys
from pathlib import Path
run, mode, lr, steps, batch = sys.argv[1:]
rows = [json.loads(line) for line in (Path(run) / "logs" / "metrics.jsonl").read_text().splitlines()]
val = [r for r in rows if "val/accuracy" in r][-1]
train = [r for r in rows if "train/loss" in r]
print(json.dumps({"unfreeze_last": mode, "lr": float(lr), "steps": int(steps), "batch_size": int(batch),
                  "val_accuracy": val["val/accuracy"], "val_loss": val.get("val/loss"),
                  "train_loss_first": train[0]["train/loss"], "train_loss_last": train[-1]["train/loss"]}))
PY
        tail -1 "$OUT"
    done
}
sweep 0 ${LRS_HEAD:-3e-4 3e-3 3e-2}
sweep 2 ${LRS_BLOCKS:-1e-5 1e-4 1e-3 3e-3}
sweep all ${LRS_ALL:-1e-5 1e-4 1e-3 3e-3}
