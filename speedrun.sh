#!/usr/bin/env bash
# The whole pipeline, one torchrun call per stage:
#   demo data -> SFT -> density weights -> reward models (uniform, density) -> GRPO (and DPO) -> evaluation report
# Every artifact goes to $NANOCHAT_BASE_DIR (default ~/.cache/nanochat). A finished stage is skipped
# (FORCE=1 re-runs everything); an interrupted one resumes from its last checkpoint, so re-running
# after a crash or Ctrl-C finishes the pipeline with no cleanup.
#
#   bash speedrun.sh                                       # demo: synthetic domain, tiny model, ~7 min on 2 CPU cores
#   BACKBONE=/path/sft_ckpt PAIRS=/path/pairs.jsonl [PROMPTS=...] [TOKENIZER=...] bash speedrun.sh
#   DENSITY=1 bash speedrun.sh                             # GRPO against the density-weighted RM
#   ARMS="uniform density" bash speedrun.sh                # GRPO against each RM, both policies evaluated
#   ARMS="uniform dpo dpo_density" bash speedrun.sh        # RM + GRPO beside DPO on the same pairs (DPO: off by default)
#   MODEL=smollm2 bash speedrun.sh                         # a real pretrained model: pipelines/model.sh
#   EXPERIMENT=density SEEDS="0 1 2 3 4" bash speedrun.sh  # the density experiment: pipelines/experiment.sh
# EVAL_PAIRS / EVAL_PROMPTS: held-out sets for your own assets; DEMO_ARGS: extra flags for scripts.kat_demo_data.
# ARMS and the knobs every variant takes (ranks, steps, *_ARGS, REGIME): pipelines/stages.sh.
set -euo pipefail
cd "$(dirname "$0")"
case ${EXPERIMENT:-} in  # before anything is made
    "") ;;
    density) exec bash pipelines/experiment.sh ;;
    *) echo "speedrun: unknown EXPERIMENT '$EXPERIMENT' (density, or unset for the pipeline)" >&2; exit 2 ;;
esac
[ -z "${MODEL:-}" ] || exec bash pipelines/model.sh
source pipelines/stages.sh

ARMS="${ARMS:-$([ "${DENSITY:-0}" = 1 ] && echo density || echo uniform)}"
check_arms "$ARMS"
DEMO=$({ [ -z "${BACKBONE:-}" ] || [ -z "${PAIRS:-}" ]; } && echo 1 || echo 0)  # no backbone and pairs given
# Each stage's flags: the pipeline's own (inputs, --out, --seed, --save_every), then the demo's recipe for its tiny
# model (the demo only: a model of your own runs with the scripts' defaults, set for real models), then *_STEPS where
# given, then *_ARGS: the last copy of a flag wins. Every stage prints the command it runs; the report lists them.
if [ "$DEMO" = 1 ]; then
    SFT_STEPS="${SFT_STEPS:-1000}"  # the arithmetic topic's copying (prompt -> call, answer -> reply) needs them
    RM_STEPS="${RM_STEPS:-150}" GRPO_STEPS="${GRPO_STEPS:-200}" DPO_STEPS="${DPO_STEPS:-100}"
    EVAL_SAMPLES="${EVAL_SAMPLES:-4}"
    RECIPE_SFT=(--batch_size 32 --lr 3e-3)
    RECIPE_RM=(--batch_size 32 --unfreeze_last 1 --lr 3e-3 --eval_every 50)
    RECIPE_GRPO=(--batch_size 8 --group_size 8 --max_new_tokens 16 --lr 1e-4 --beta 0.02 --eval_every 50)
    RECIPE_DPO=(--batch_size 32 --lr 1e-4 --beta 0.1 --eval_every 50)
else
    RECIPE_SFT=() RECIPE_RM=() RECIPE_GRPO=() RECIPE_DPO=()
fi
stage_flags

# ---- demo stages: only when no real backbone and pairs are given ----------------------------------
if [ "$DEMO" = 1 ]; then
    if skip "$B/demo/.complete"; then echo "== demo_data: skipped (done)"; else
        echo "== demo_data"; s=$SECONDS
        python -m scripts.kat_demo_data --seed "$SEED" ${DEMO_ARGS:-}
        touch "$B/demo/.complete"; record_time demo_data $((SECONDS - s))
    fi
    TOKENIZER="$B/tokenizer"
    PAIRS="$B/demo/pairs.jsonl"
    PROMPTS="$B/demo/prompts.jsonl"
    train sft "the base model and demo/sft.jsonl, made by demo_data" "$B/chatsft_checkpoints/default" scripts.kat_sft --backbone "$B/base_checkpoints/demo" \
        --tokenizer "$TOKENIZER" --conversations "$B/demo/sft.jsonl" --seed "$SEED" --save_every 100 \
        "${RECIPE_SFT[@]}" "${STEPS_SFT[@]}" "${EXTRA_SFT[@]}"
    BACKBONE="$B/chatsft_checkpoints/default"
fi
PROMPTS="${PROMPTS:-$PAIRS}"
TOK=()
[ -n "${TOKENIZER:-}" ] && TOK=(--tokenizer "$TOKENIZER")
for f in "$PAIRS" "$PROMPTS"; do
    [ -s "$f" ] || { echo "speedrun: $f is missing or empty (PAIRS/PROMPTS, or the demo_data stage makes them)" >&2; exit 2; }
done

# ---- density, reward models, GRPO ----------------------------------------------------------------
density density "$BACKBONE" "$PAIRS" "$WEIGHTS" "${TOK[@]}"
case " $ARMS " in *" fork "*) density density_fork "$BACKBONE" "$PAIRS" "$FORK_WEIGHTS" "${TOK[@]}" --weighting fork ;; esac
RM_FLAGS=(--backbone "$BACKBONE" "${TOK[@]}" --pairs "$PAIRS" --seed "$SEED" --save_every "$SAVE_EVERY"
          "${RECIPE_RM[@]}" "${STEPS_RM[@]}")
NEEDS_RM="a backbone ($BACKBONE: made by the sft stage, or given as BACKBONE) with its tokenizer, and pairs ($PAIRS)"
train rm_uniform "$NEEDS_RM" "$B/rm_checkpoints/uniform" scripts.kat_train_rm "${RM_FLAGS[@]}" "${EXTRA_RM[@]}"
train rm_density "$NEEDS_RM and density weights (made by the density stage)" "$B/rm_checkpoints/density" scripts.kat_train_rm "${RM_FLAGS[@]}" --density "$WEIGHTS" "${EXTRA_RM[@]}"
if [[ " $ARMS " == *" fork "* ]]; then train rm_fork "$NEEDS_RM and fork weights (made by the density_fork stage)" \
    "$B/rm_checkpoints/fork" scripts.kat_train_rm "${RM_FLAGS[@]}" --density "$FORK_WEIGHTS" "${EXTRA_RM[@]}"; fi
GRPO_FLAGS=(--policy "$BACKBONE" "${TOK[@]}" --prompts "$PROMPTS" --seed "$SEED"
            --save_every "$([ -n "${GRPO_STEPS:-}" ] && [ "$GRPO_STEPS" -le 100 ] && echo $(( (GRPO_STEPS + 1) / 2 )) ||
                             echo "$SAVE_EVERY")" "${RECIPE_GRPO[@]}" "${STEPS_GRPO[@]}")
DPO_FLAGS=("${TOK[@]}" --seed "$SEED" --save_every "$SAVE_EVERY" "${RECIPE_DPO[@]}" "${STEPS_DPO[@]}")
# Each arm: GRPO against its own RM, and nothing else different (same policy, prompts, budget and seed),
# so a difference between the policies is the RM's doing. A DPO arm trains the same policy on the pairs themselves.
for arm in $ARMS; do
    case $arm in  # (checked by check_arms)
        kl_*) rm_name=uniform; ARM_FLAGS=(--beta "${arm#kl_}") ;;  # after GRPO_ARGS: the arm is its beta
        dpo|dpo_density) dpo_arm "$arm" "$BACKBONE" "$PAIRS" "${DPO_FLAGS[@]}"; continue ;;
        *) rm_name=$arm; ARM_FLAGS=() ;;
    esac
    train "grpo_$arm" "the policy $BACKBONE, prompts ($PROMPTS) and the reward model in rm_checkpoints/$rm_name (made by the rm_$rm_name stage)" \
        "$B/chatrl_checkpoints/$arm" scripts.kat_train_grpo "${GRPO_FLAGS[@]}" --rm "$B/rm_checkpoints/$rm_name" \
        "${EXTRA_GRPO[@]}" "${ARM_FLAGS[@]}"
    EVAL_POLICIES+=(--policy "GRPO $arm=$B/chatrl_checkpoints/$arm")
done

# ---- evaluation report ---------------------------------------------------------------------------
TRAINED=(); for arm in $ARMS; do TRAINED+=("$(arm_dir "$arm")"); done
if eval_fresh "${TRAINED[@]}"; then
    echo "== eval: skipped (done: $B/report.md)"
else
    echo "== eval ($NPROC_PER_NODE ranks)"; s=$SECONDS
    # Held-out sets: the demo's, or EVAL_PAIRS and EVAL_PROMPTS; else what the trainers held out of the training files
    # (--val_ratio 0.1 of the prompts, by prefix_id), which the report says.
    HOLDOUT=()
    if [ -f "$B/demo/eval_pairs.jsonl" ]; then
        EVAL_PAIRS="$B/demo/eval_pairs.jsonl" EVAL_PROMPTS="$B/demo/eval_prompts.jsonl"
    elif [ -z "${EVAL_PAIRS:-}" ] || [ -z "${EVAL_PROMPTS:-}" ]; then
        EVAL_PAIRS="$PAIRS" EVAL_PROMPTS="$PROMPTS" HOLDOUT=(--eval_holdout 0.1)
    fi
    # Policies are scored by the uniform RM, one judge for every arm (the demo's ground truth is judged too), at the
    # length the GRPO policies trained with.
    EVAL=(--eval_pairs "$EVAL_PAIRS" --eval_prompts "$EVAL_PROMPTS" "${HOLDOUT[@]}" --seed "$SEED" "${EVAL_POLICIES[@]}"
          --score_rm "$B/rm_checkpoints/uniform" "${SAMPLES[@]}" $(eval_tokens))
    [ -d "$B/chatsft_checkpoints/default" ] || EVAL+=(--policy_before "$BACKBONE")
    # The demo's tool use (demo/eval_arithmetic.jsonl): judged by its ground truth, with and without the calculator
    [ -f "$B/demo/eval_arithmetic.jsonl" ] && EVAL+=(--reward_fn nanochat_ext.tasks.synthetic:task_reward --pass_k 4)
    launch eval "the reward models, the GRPO policy and held-out data" scripts.kat_eval "${EVAL[@]}" "${EXTRA_EVAL[@]}"
    record_time eval $((SECONDS - s))
fi

echo "== speedrun finished in $((SECONDS - t_start)) s; report: $B/report.md"
python -m scripts.kat_pipeline summary "$B/report.json"
