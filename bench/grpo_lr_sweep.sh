#!/usr/bin/env bash
# GRPO's learning rate on a real model (#66): SmolLM2-135M-Instruct on word arithmetic with the task's reward, the
# word_arithmetic preset (4 prompts x 8 samples, 16 new tokens, 40 steps, beta 0) at each lr, seed 0; held-out greedy
# accuracy at each evaluation (every 10 steps), its best and its last. One JSON line per run into $OUT.
#
#   MODEL_DIR=~/.cache/nanochat/models/smollm2-135m-instruct bash bench/grpo_lr_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
MODEL_DIR="${MODEL_DIR:?the converted SmolLM2 dir (MODEL=smollm2 bash speedrun.sh makes it)}"
WORK="${WORK:-$(mktemp -d)}"
OUT="${OUT:-bench/results/grpo_lr_sweep_$(date +%F).jsonl}"
[ -f "$WORK/task/.complete" ] || python -m scripts.kat_task_data --task word_arithmetic --out "$WORK/task"
for lr in ${LRS:-1e-5 3e-5 1e-4 3e-4 1e-3}; do
    run="$WORK/grpo_$lr"
    python -m scripts.kat_train_grpo --policy "$MODEL_DIR" --prompts "$WORK/task/train.jsonl" \
        --eval_prompts "$WORK/task/eval.jsonl" --preset word_arithmetic --lr "$lr" --seed 0 --save_every 0 \
        --out "$run" > "$run.log" 2>&1 || { echo "failed: $lr (log $run.log)"; continue; }
    python - "$run" "$lr" >> "$OUT" <<'PY' || echo "no metrics: $lr (log $run.log)"
import json, sys
from pathlib import Path
run, lr = sys.argv[1:]
rows = [json.loads(line) for line in (Path(run) / "logs" / "metrics.jsonl").read_text().splitlines()]
evals = [(r["step"], r["eval/reward_greedy"]) for r in rows if "eval/reward_greedy" in r]
train = [r["train/reward"] for r in rows if "train/reward" in r]
print(json.dumps({"lr": float(lr), "steps": len(train), "eval_greedy": evals, "best": max(a for _, a in evals),
                  "last": evals[-1][1], "train_reward_last10": sum(train[-10:]) / len(train[-10:]),
                  "grad_norm_max": max(r["train/grad_norm"] for r in rows if "train/grad_norm" in r)}))
PY
    tail -1 "$OUT"
done
