#!/usr/bin/env bash
# A real pretrained model on a verifiable task (speedrun.sh runs it with MODEL=smollm2): SmolLM2-135M-Instruct,
# fetched and converted once, then GRPO with the task's reward. No reward model here: the task's reward checks the
# answer itself, which an RM learned from pairs would only approximate. With ARMS="dpo dpo_density", DPO on the task's
# pairs instead (the density experiment's arms). Then the report: held-out accuracy before and after, greedy and
# sampled (per kind of question), and the learning curve against training seconds.
#
#   MODEL=smollm2 bash speedrun.sh                      # arithmetic in words, taught by GRPO
#   MODEL=smollm2 TASK=multiplication bash speedrun.sh  # SFT on a tool's call format, then GRPO with the tool
#   MODEL=smollm2 TASK=code_functions bash speedrun.sh  # Python functions run sealed against tests (two tries)
#   MODEL=smollm2 ARMS="dpo dpo_density" OWN_PAIRS=1 bash speedrun.sh  # DPO on pairs in the model's own words (its
#                                                       # 8 samples a question, the best chosen over the worst)
set -euo pipefail
source "$(dirname "$0")/stages.sh"
ARMS="${ARMS:-$([ "${DENSITY:-0}" = 1 ] && echo density || echo uniform)}"
check_arms "$ARMS"
[ "${MODEL:-}" = smollm2 ] || { echo "speedrun: unknown MODEL '${MODEL:-}' (smollm2)" >&2; exit 2; }
case "${TASK:-word_arithmetic}" in
    word_arithmetic|word_arithmetic_skewed|word_arithmetic_gap|multiplication) TASK_REWARD=last_number ;;
    code_functions) TASK_REWARD=nanochat_ext.tasks.code_tests:passes ;;  # its tests, run sealed: one attempt
    *) echo "speedrun: unknown TASK '$TASK' (word_arithmetic, word_arithmetic_skewed, word_arithmetic_gap," \
            "multiplication, code_functions)" >&2
       exit 2 ;; esac
model_arms "$ARMS"
# a real model runs with the scripts' defaults (and a task's --preset); the report records TASK as given
DEMO=0 RECIPE_SFT=() RECIPE_RM=() RECIPE_GRPO=() RECIPE_DPO=()
stage_flags
TASK="${TASK:-word_arithmetic}"
echo "== fetch_model"; s=$SECONDS
MODEL_DIR=$(fetch_model)  # cached after the first run
record_time fetch_model $((SECONDS - s))
TASK_DIR="$B/tasks/$TASK"
SIZES=()  # the skewed set: 800 pairs (the density stage embeds each prompt), 24 held-out questions a kind
[[ "$TASK" == word_arithmetic_skewed || "$TASK" == word_arithmetic_gap ]] && SIZES=(--n_train 800 --n_eval 96)
if skip "$TASK_DIR/.complete"; then echo "== task_data: skipped (done: $TASK_DIR)"; else
    echo "== task_data"; python -m scripts.kat_task_data --task "$TASK" --out "$TASK_DIR" --seed "$SEED" "${SIZES[@]}"; fi
EVAL_POLICIES=() TOOL_EVAL=() TRAINED=()
if [[ " $ARMS " == *" dpo"* ]]; then  # DPO on the task's pairs (the density experiment's arms), no GRPO
    PAIRS_FILE="$TASK_DIR/pairs.jsonl" TOKENS=(--max_new_tokens 32)
    if [ "${OWN_PAIRS:-0}" = 1 ]; then  # the pairs in the model's own words, at GRPO's completion length
        PAIRS_FILE="$B/own_pairs/pairs.jsonl" TOKENS=(--max_new_tokens 16)
        if skip "$PAIRS_FILE"; then echo "== own_pairs: skipped (done: $PAIRS_FILE)"; else
            echo "== own_pairs ($NPROC_PER_NODE ranks)"; s=$SECONDS
            rm -f "$PAIRS_FILE"  # FORCE=1: drawn again (the script refuses to overwrite)
            launch own_pairs "the model ($MODEL_DIR) and the task's prompts ($TASK_DIR/train.jsonl)" \
                scripts.kat_own_pairs --policy "$MODEL_DIR" --prompts "$TASK_DIR/train.jsonl" \
                --reward_fn "$TASK_REWARD" "${TOKENS[@]}" --samples 8 --seed "$SEED" "${EXTRA_OWN_PAIRS[@]}" \
                --out "$PAIRS_FILE"  # last: the pipeline's (a --reward_fn in OWN_PAIRS_ARGS adds one: they sum)
            record_time own_pairs $((SECONDS - s))
        fi
    fi
    [[ " $ARMS " == *" dpo_density "* ]] && density density "$MODEL_DIR" "$PAIRS_FILE" "$WEIGHTS"
    for arm in $ARMS; do
        # 16 steps of 16 pairs (about 6 s a step on 2 cores) at lr 1e-5, set once on a pilot seed (100, the uniform
        # arm only; docs/density.md) before any density arm ran. No validation split: every pair trains; the
        # held-out questions judge.
        dpo_arm "$arm" "$MODEL_DIR" "$PAIRS_FILE" --seed "$SEED" --save_every "$SAVE_EVERY" \
            --batch_size 16 --lr 1e-5 --val_ratio 0 --eval_every 0 --max_steps "${DPO_STEPS:-16}"
        TRAINED+=("$(arm_dir "$arm")")
    done
    # the task's pairs: room for a reply that works the sum out before its answer (DPO never generates in
    # training); one sample a question beside the greedy reply (own pairs: four, as the GRPO form's)
    SAMPLES=(--samples "${EVAL_SAMPLES:-$([ "${OWN_PAIRS:-0}" = 1 ] && echo 4 || echo 1)}")
else
    START="$MODEL_DIR" POLICY="$B/chatrl_checkpoints/$MODEL"
    if [ "$TASK" = multiplication ]; then  # a tool the model has never called: its call format taught first
        TOOL=nanochat_ext.tasks.multiplication:multiply
        START="$B/chatsft_checkpoints/${MODEL}_tools"
        train "sft_$MODEL" "the model ($MODEL_DIR) and the task's demonstrations ($TASK_DIR/sft.jsonl)" "$START" \
            scripts.kat_sft --backbone "$MODEL_DIR" --conversations "$TASK_DIR/sft.jsonl" --tools "$TOOL" \
            --batch_size 8 --max_steps "${SFT_STEPS:-8}" --seed "$SEED" "${EXTRA_SFT[@]}"
        EVAL_POLICIES=(--policy "SFT (tool format)=$START") TRAINED=("$START")
        TOOL_EVAL=(--tools "$TOOL" --tool_prompts "$TASK_DIR/eval.jsonl" --tool_max_new_tokens 96)
        POLICY+=_tools
    fi
    [ "$TASK" = code_functions ] && POLICY+=_code  # its own dir: the task changes what the policy learns
    # density: each training prompt weighted by its inverse density in the model's own embeddings (the density
    # experiment's GRPO form), its pairs' prompts being the training prompts
    [[ " $ARMS " == *" density "* ]] && density density "$MODEL_DIR" "$TASK_DIR/pairs.jsonl" "$WEIGHTS"
    PRESET=${TASK%_skewed} PRESET=${PRESET%_gap}  # a skewed set's recipe is its task's
    for arm in $ARMS; do
        dir=$POLICY stage="grpo_$MODEL" name="GRPO $MODEL" weights=()
        [ "$ARMS" = uniform ] || name="GRPO $arm"  # the experiment report's names for its arms
        [ "$arm" = density ] && dir+=_density stage+=_density weights=(--density "$WEIGHTS")
        train "$stage" "the model ($START) and the task's prompts ($TASK_DIR)${weights:+ and density weights}" "$dir" \
            scripts.kat_train_grpo --policy "$START" --prompts "$TASK_DIR/train.jsonl" \
            --eval_prompts "$TASK_DIR/eval.jsonl" --preset "$PRESET" "${STEPS_GRPO[@]}" --seed "$SEED" \
            --save_every "$SAVE_EVERY" "${weights[@]}" "${EXTRA_GRPO[@]}"
        EVAL_POLICIES+=(--policy "$name=$dir") TRAINED+=("$dir")
    done
    read -r -a TOKENS <<< "$(max_new_tokens "$dir")"
fi
if eval_fresh "${TRAINED[@]}"; then echo "== eval: skipped (done: $B/report.md)"; else
    echo "== eval ($NPROC_PER_NODE ranks)"; s=$SECONDS
    launch eval "the trained policies and the task's held-out prompts" scripts.kat_eval \
        --policy_before "$MODEL_DIR" --before_name "before ($MODEL)" "${EVAL_POLICIES[@]}" \
        --eval_prompts "$TASK_DIR/eval.jsonl" --reward_fn "$TASK_REWARD" "${SAMPLES[@]}" --seed "$SEED" \
        "${TOKENS[@]}" "${TOOL_EVAL[@]}" "${EXTRA_EVAL[@]}"
    record_time eval $((SECONDS - s))
fi
echo "== speedrun finished in $((SECONDS - t_start)) s; report: $B/report.md"
python -m scripts.kat_pipeline summary "$B/report.json" --model
