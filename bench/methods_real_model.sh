#!/usr/bin/env bash
# The RL methods side by side on a real model (issue #68): GRPO, RLOO and REINFORCE++-baseline on SmolLM2-135M-Instruct's
# word arithmetic, each run with speedrun.sh's MODEL=smollm2 recipe (--preset word_arithmetic: 4 questions x 8 samples
# of up to 16 tokens, lr 3e-5, no KL, 40 steps) at the same seeds, each estimator as its reference runs it by default;
# then on-policy distillation of the GRPO-trained policy of the first seed (the teacher) into the fresh model, with no
# reward: the task's reward stays at weight 0, so it only scores the held-out evaluations. Every run is
# bench/ours_real_model.py (held-out greedy and sampled accuracy at step 0 and every EVAL_EVERY steps, against training
# seconds); its JSON lines, tagged with the run's label and seed, are appended to OUT, and a run whose summary OUT
# already holds is skipped (rerun the command to go on after a stop). The table (bench/methods_table.py) at the end.
#
#   bash bench/methods_real_model.sh MODEL_DIR TASK_DIR [OUT.jsonl]
#   MODEL_DIR: python -m scripts.kat_fetch_model --model smollm2 | tail -n 1
#   TASK_DIR:  python -m scripts.kat_task_data --task word_arithmetic --out TASK_DIR --seed 0
#
# The methods run in turn, their order turned by one at each seed. Knobs: SEEDS (0 1 2), METHODS (grpo rloo
# reinforce_pp_baseline; grpo_async and grpo_async_tis: issue 82's --async_rollouts 1, without and with
# --engine_correction token_truncate), DISTILL_SEEDS (SEEDS; "" for none), STEPS (40),
# EVAL_EVERY (10), THREADS (2), TEACHER (where the first seed's GRPO policy is kept: $NANOCHAT_BASE_DIR/methods_teacher,
# $NANOCHAT_BASE_DIR as speedrun.sh's).
# Default OUT: bench/results/methods_real_model_<date>.jsonl; the runs' logs go to OUT with .log for .jsonl.
set -eEuo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: bash bench/methods_real_model.sh MODEL_DIR TASK_DIR [OUT.jsonl]" >&2; exit 2
fi
[ -f "$1/config.json" ] || { echo "error: $1: no config.json (a Hugging Face model dir)" >&2; exit 2; }
for f in train.jsonl eval.jsonl; do
    [ -f "$2/$f" ] || { echo "error: $2: no $f (python -m scripts.kat_task_data --out DIR writes it)" >&2; exit 2; }
done
MODEL_DIR=$(cd "$1" && pwd)
TASK_DIR=$(cd "$2" && pwd)
if [ $# -eq 3 ]; then
    mkdir -p "$(dirname "$3")"
    OUT="$(cd "$(dirname "$3")" && pwd)/$(basename "$3")"
fi
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
OUT=${OUT:-$PWD/bench/results/methods_real_model_$(date +%F).jsonl}
LOG="${OUT%.jsonl}.log"
SEEDS=${SEEDS:-0 1 2} METHODS=${METHODS:-grpo rloo reinforce_pp_baseline} STEPS=${STEPS:-40}
EVAL_EVERY=${EVAL_EVERY:-10} THREADS=${THREADS:-2}
DISTILL_SEEDS=${DISTILL_SEEDS-$SEEDS}
FIRST_SEED=${SEEDS%% *}
TEACHER=${TEACHER:-${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}/methods_teacher}
touch "$OUT"

method_args() {  # each estimator with its reference implementation's defaults
    case $1 in
        grpo) echo "" ;;  # TRL's GRPOTrainer: r minus the group's mean over the group's std
        # TRL's RLOOTrainer's advantages (normalize_advantages=False), GRPO's token-mean loss (TRL's own loss form:
        # --importance_level sequence_product --loss_agg sequence, each completion weighted alike)
        rloo) echo "--advantage rloo --scale_rewards none" ;;
        reinforce_pp_baseline) echo "--advantage reinforce_pp_baseline" ;;  # OpenRLHF: whitened over the batch
        reinforce_pp) echo "--advantage reinforce_pp" ;;
        # issue 82: GRPO one step off-policy, the next rollout sampled in a thread while a step trains; then the same
        # with the engine's log-probs corrected to the trainer's (TRL's truncated importance sampling, cap 3)
        grpo_async) echo "--async_rollouts 1" ;;
        grpo_async_tis) echo "--async_rollouts 1 --engine_correction token_truncate" ;;
        *) echo "error: unknown method '$1' in METHODS (grpo, rloo, reinforce_pp, reinforce_pp_baseline, grpo_async," \
                "grpo_async_tis)" >&2
           return 2 ;;
    esac
}

done_already() {  # done_already LABEL SEED: OUT holds the run's summary
    python - "$OUT" "$1" "$2" <<'PY'
import json, sys
out, label, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = [json.loads(l) for l in open(out) if l.strip()]
sys.exit(0 if any(r.get("bench") == "ours_time_to_accuracy_summary" and r.get("label") == label
                  and r.get("seed") == seed for r in runs) else 1)
PY
}

run() {  # run LABEL SEED GRPO_ARGS [--keep DIR]
    local label=$1 seed=$2 grpo_args=$3; shift 3
    if done_already "$label" "$seed"; then echo "== $label seed $seed: skipped (in $OUT)"; return; fi
    echo "== $label seed $seed: $grpo_args"
    local s=$SECONDS
    python bench/ours_real_model.py --model "$MODEL_DIR" --task "$TASK_DIR" --steps "$STEPS" \
        --eval_every "$EVAL_EVERY" --threads "$THREADS" --seed "$seed" --label "$label" --grpo_args="$grpo_args" "$@" \
        2>>"$LOG" | tee -a "$OUT" | tail -n 1 ||
        { echo "error: $label seed $seed failed: its last lines are in $LOG" >&2; exit 1; }
    echo "   $((SECONDS - s)) s"
}

for m in $METHODS; do method_args "$m" >/dev/null; done  # every name checked before the first run
if [ -n "$DISTILL_SEEDS" ] && [[ " $METHODS " != *" grpo "* ]] && ! ls "$TEACHER"/meta_*.json >/dev/null 2>&1; then
    echo "error: distillation needs a teacher: METHODS must include grpo (or TEACHER a trained policy; DISTILL_SEEDS= for none)" >&2
    exit 2
fi
rotated() {  # the methods, their order turned by one a seed: with as many seeds as methods (or a multiple), each
            # method runs at every place in the order alike, so a drift of the machine falls on each the same
    local -a all=($METHODS)
    local n=${#all[@]} k
    for k in $(seq 0 $((n - 1))); do echo "${all[$(((k + $1) % n))]}"; done
}
i=0
for seed in $SEEDS; do
    for m in $(rotated $i); do
        keep=()
        if [ "$m" = grpo ] && [ "$seed" = "$FIRST_SEED" ]; then  # the teacher: a fresh dir, so no stale checkpoint resumes
            done_already grpo "$seed" || rm -rf "$TEACHER"
            keep=(--keep "$TEACHER")
        fi
        run "$m" "$seed" "$(method_args "$m")" "${keep[@]}"
    done
    i=$((i + 1))
done
if [ -n "$DISTILL_SEEDS" ]; then
    ls "$TEACHER"/meta_*.json >/dev/null 2>&1 ||
        { echo "error: no teacher in $TEACHER (METHODS must include grpo, run at the first of SEEDS)" >&2; exit 2; }
    for seed in $DISTILL_SEEDS; do
        run distill "$seed" "--advantage distill --teacher $(printf %q "$TEACHER") --reward_weights 0"
    done
fi
python bench/methods_table.py "$OUT"
