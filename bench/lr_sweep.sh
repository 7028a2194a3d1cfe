#!/usr/bin/env bash
# Each trainer's learning rate on a real model (#66): SmolLM2-135M-Instruct trained at a few rates per method, on the
# task this project's recipes train it on; one JSON line per rate into OUT (bench/lr_sweep_row.py reads the run).
#   rm    word-arithmetic pairs (the right number chosen, a near miss rejected), STEPS (30) steps of BATCH (8) for each
#         of --unfreeze_last 0 (the head), 2 (the last two blocks) and all: held-out pair accuracy and loss
#   grpo  word arithmetic with the task's reward, its preset (4 prompts x 8 samples, 16 new tokens, 40 steps, beta 0),
#         seed 0: held-out greedy accuracy at each evaluation (every 10 steps), its best and its last
#   dpo   pairs in the model's own words (kat_own_pairs on word_arithmetic_gap's 800 questions; PAIRS=FILE reuses
#         such a file), 16 steps of 16 at beta 0.1 as the density experiment's arms: held-out greedy and sampled
#         accuracy (kat_eval, 4 samples a question)
#   sft   the multiply tool's worked conversations, 8 steps of 8 as MODEL=smollm2 TASK=multiplication's SFT: held-out
#         greedy accuracy with the tool and calls per reply (kat_eval --tool_prompts)
#
#   MODEL_DIR=~/.cache/nanochat/models/smollm2-135m-instruct bash bench/lr_sweep.sh rm|grpo|dpo|sft
# Knobs: LRS (the rates; rm: LRS_HEAD, LRS_BLOCKS, LRS_ALL), WORK (the data and the runs; a new temp dir by default;
# a rate's run starts again from scratch), OUT (bench/results/<method>_lr_sweep_<date>.jsonl, appended to), KEEP=1
# (keep each run's checkpoint: 0.5 GB a run). Exit 1 where a run or its row failed.
set -euo pipefail
METHOD="${1:-}"
case "$METHOD" in rm|grpo|dpo|sft) ;;
    *) echo "usage: MODEL_DIR=... bash bench/lr_sweep.sh rm|grpo|dpo|sft" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
MODEL_DIR="${MODEL_DIR:?the converted SmolLM2 dir (MODEL=smollm2 bash speedrun.sh makes it)}"
WORK="${WORK:-$(mktemp -d)}"
OUT="${OUT:-bench/results/${METHOD}_lr_sweep_$(date +%F).jsonl}"

echo "lr_sweep $METHOD: runs in $WORK (a run's checkpoint is removed once its row is written; KEEP=1 keeps it)"
FAILED=0

task() {  # dir task [kat_task_data flags]: the task's data in $WORK/<dir>, made once
    [ -f "$WORK/$1/.complete" ] || python -m scripts.kat_task_data --task "$2" --out "$WORK/$1" "${@:3}"
}
train() {  # run lr command...: one run from scratch, its log beside it and run.done once it ends well; a failure is
    # counted and the sweep goes on without it
    local run="$1" lr="$2"; shift 2
    rm -rf "$run" "$run.done"
    if "$@" --lr "$lr" --seed 0 --save_every 0 --out "$run" > "$run.log" 2>&1; then touch "$run.done"; return; fi
    echo "failed: $lr (log $run.log)"; FAILED=$((FAILED + 1)); return 1
}
row() {  # method run lr [more]: the run's JSON line into OUT, shown; then its checkpoint removed
    if python bench/lr_sweep_row.py "$@" >> "$OUT"; then tail -1 "$OUT"
    else echo "no row: $1 $3 (log $2.log)"; FAILED=$((FAILED + 1)); fi
    [ "${KEEP:-0}" = 1 ] || rm -rf "$2"/model_* "$2"/state_* "$2"/shards_*
}
evaluate() {  # flags...: one kat_eval over the model and every rate that trained, into $WORK/$METHOD.report.json
    local policies=()
    for lr in $LRS; do [ -f "$WORK/${METHOD}_$lr.done" ] && policies+=(--policy "lr $lr=$WORK/${METHOD}_$lr"); done
    [ ${#policies[@]} -gt 0 ] || { echo "no $METHOD run ended well: nothing to evaluate" >&2; exit 1; }
    python -m scripts.kat_eval --base_dir "$WORK" --policy_before "$MODEL_DIR" --before_name "before" "${policies[@]}" \
        --seed 0 --out "$WORK/$METHOD.report.md" "$@" > "$WORK/$METHOD.eval.log" 2>&1 ||
        { echo "the evaluation failed (log $WORK/$METHOD.eval.log)" >&2; exit 1; }
}

case "$METHOD" in
rm)
    STEPS="${STEPS:-30}" BATCH="${BATCH:-8}"  # the recorded sweep: bench/results/rm_lr_sweep_2026-11-27.jsonl
    task rm_task word_arithmetic --n_train 800
    for mode in 0 2 all; do
        case $mode in 0) lrs=${LRS_HEAD:-3e-4 3e-3 3e-2} ;; 2) lrs=${LRS_BLOCKS:-1e-5 1e-4 1e-3 3e-3} ;;
                      all) lrs=${LRS_ALL:-1e-5 1e-4 1e-3 3e-3} ;; esac
        for lr in $lrs; do
            run="$WORK/rm_${mode}_$lr"
            train "$run" "$lr" python -m scripts.kat_train_rm --backbone "$MODEL_DIR" --pairs "$WORK/rm_task/pairs.jsonl" \
                --unfreeze_last "$mode" --max_steps "$STEPS" --batch_size "$BATCH" --eval_every 0 --log_every 10 \
                && row rm "$run" "$lr" "$mode" "$STEPS" "$BATCH"
        done
    done ;;
grpo)
    LRS="${LRS:-1e-5 3e-5 1e-4 3e-4 1e-3}"
    task grpo_task word_arithmetic
    for lr in $LRS; do
        train "$WORK/grpo_$lr" "$lr" python -m scripts.kat_train_grpo --policy "$MODEL_DIR" \
            --prompts "$WORK/grpo_task/train.jsonl" --eval_prompts "$WORK/grpo_task/eval.jsonl" --preset word_arithmetic \
            && row grpo "$WORK/grpo_$lr" "$lr"
    done ;;
dpo)
    LRS="${LRS:-3e-6 1e-5 3e-5 1e-4 3e-4}"
    task dpo_task word_arithmetic_gap --n_train 800 --n_eval 96
    PAIRS="${PAIRS:-$WORK/dpo_task/own_pairs.jsonl}"
    [ -f "$PAIRS" ] || python -m scripts.kat_own_pairs --policy "$MODEL_DIR" --prompts "$WORK/dpo_task/train.jsonl" \
        --reward_fn last_number --max_new_tokens 16 --samples 8 --seed 0 --out "$PAIRS"
    for lr in $LRS; do
        train "$WORK/dpo_$lr" "$lr" python -m scripts.kat_train_dpo --policy "$MODEL_DIR" --pairs "$PAIRS" \
            --batch_size 16 --val_ratio 0 --eval_every 0 --max_steps 16 || true
    done
    evaluate --eval_prompts "$WORK/dpo_task/eval.jsonl" --reward_fn last_number --max_new_tokens 16 --samples 4
    for lr in $LRS; do [ -f "$WORK/dpo_$lr.done" ] && row dpo "$WORK/dpo_$lr" "$lr" "$WORK/dpo.report.json"; done ;;
sft)
    LRS="${LRS:-2e-6 2e-5 2e-4 2e-3}"
    task sft_task multiplication --n_eval 32
    TOOL=nanochat_ext.tasks.multiplication:multiply
    for lr in $LRS; do
        train "$WORK/sft_$lr" "$lr" python -m scripts.kat_sft --backbone "$MODEL_DIR" \
            --conversations "$WORK/sft_task/sft.jsonl" --tools "$TOOL" --batch_size 8 --max_steps 8 || true
    done
    evaluate --eval_prompts "$WORK/sft_task/eval.jsonl" --reward_fn last_number --samples 1 --tools "$TOOL" \
        --tool_prompts "$WORK/sft_task/eval.jsonl" --max_new_tokens 96 --tool_max_new_tokens 96
    for lr in $LRS; do [ -f "$WORK/sft_$lr.done" ] && row sft "$WORK/sft_$lr" "$lr" "$WORK/sft.report.json"; done ;;
esac
[ "$FAILED" = 0 ] || { echo "lr_sweep $METHOD: $FAILED run(s) failed" >&2; exit 1; }
