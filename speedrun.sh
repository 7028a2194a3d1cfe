#!/usr/bin/env bash
# The whole pipeline, one torchrun call per stage:
#   demo data -> SFT -> density weights -> reward models (uniform, density) -> GRPO (and DPO) -> evaluation report
# Every artifact goes to $NANOCHAT_BASE_DIR (default ~/.cache/nanochat). A finished stage is skipped
# (FORCE=1 re-runs everything); an interrupted one resumes from its last checkpoint, so re-running
# after a crash or Ctrl-C finishes the pipeline with no cleanup.
#
#   bash speedrun.sh                                       # demo: synthetic domain, tiny model, ~3 min on 2 CPU cores
#   BACKBONE=/path/sft_ckpt PAIRS=/path/pairs.jsonl [PROMPTS=...] [TOKENIZER=...] bash speedrun.sh
#   DENSITY=1 bash speedrun.sh                             # GRPO against the density-weighted RM
#   ARMS="uniform density" bash speedrun.sh                # GRPO against each RM, both policies evaluated
#   ARMS="uniform dpo dpo_density" bash speedrun.sh        # RM + GRPO beside DPO on the same pairs (DPO: off by default)
#   EXPERIMENT=density SEEDS="0 1 2 3 4" bash speedrun.sh  # the density experiment: every seed, both arms,
#                                                          # paired differences with 95% intervals (experiment.md)
#   EXPERIMENT=density REGIME=collapse SEEDS="$(seq -s ' ' 0 9)" bash speedrun.sh  # the same where GRPO collapses
#   MODEL=smollm2 bash speedrun.sh                         # a real pretrained model (SmolLM2-135M-Instruct, fetched
#                                                          # and converted once) taught arithmetic in words by GRPO
#   MODEL=smollm2 TASK=multiplication bash speedrun.sh     # the same model taught to multiply with a tool: SFT on the
#                                                          # call format, then GRPO with the tool in its rollouts
#   MODEL=smollm2 TASK=code_functions bash speedrun.sh     # the same model writing Python functions, run sealed
#                                                          # against tests (CodeTests: two tries, the error read back)
#   EXPERIMENT=density MODEL=smollm2 SEEDS="0 1 2 3 4" bash speedrun.sh  # the density question on the real model: skewed
#                                                          # pairs, DPO uniform and density-weighted, accuracy per kind
#   EXPERIMENT=density MODEL=smollm2 ARMS="uniform density" bash speedrun.sh  # its GRPO form, rare the kinds it is behind on
#   EXPERIMENT=density MODEL=smollm2 OWN_PAIRS=1 bash speedrun.sh  # its DPO form on the GRPO form's skew, the pairs in
#                                                          # the model's own words (its samples judged by the reward)
# Knobs: NPROC_PER_NODE (default: GPUs, else 2 gloo ranks), MAX_RESTARTS (torchrun restarts a stage that lost a rank
# this many times, each resuming from the stage's newest checkpoint; default 1; one rank runs without torchrun),
# SFT_STEPS, RM_STEPS, GRPO_STEPS, DPO_STEPS, EVAL_SAMPLES,
# EVAL_PAIRS / EVAL_PROMPTS (held-out sets for your own assets),
# DEMO_ARGS (extra flags for scripts.kat_demo_data, e.g. smaller data sets), SEED (data and training),
# BACKEND (process-group backend for every stage, e.g. nccl; default nccl on GPUs, gloo on CPU; the tests run
# cuda:gloo on CPU, a gloo group that serves only CUDA tensors, to hold the CPU pipeline to NCCL's device rule),
# NANOCHAT_VINTAGE (feb2026 or mar2026a, only for a March-2026 checkpoint whose vintage cannot be told).
# SFT_ARGS, RM_ARGS, GRPO_ARGS, DPO_ARGS, EVAL_ARGS, OWN_PAIRS_ARGS: more flags for that stage's script (split on spaces), after the stage's
# own, so the last copy of a flag wins (e.g. GRPO_ARGS="--lr 1e-3 --beta 0"; a kl_<beta> arm's --beta comes after
# them); each stage's meta records its args, the report these strings, REGIME and the step counts. --out and
# --resume stay the pipeline's. A finished stage is skipped whatever these say: change them in a new
# NANOCHAT_BASE_DIR, or re-run with FORCE=1.
# ARMS: GRPO arms, each against its RM: uniform, density (the inverse-density-weighted RM) and fork (an RM
# with the fork's 1/kNN-distance weighting, which favours dense prompts); kl_<beta> (e.g. kl_0.05): the uniform
# RM with --beta <beta>, a control that fights collapse with the KL term instead of the RM; dpo: DPO of the SFT
# policy on the pairs themselves, no RM; dpo_density: the same with each pair's density weight (as the density RM's);
# default: uniform, or density with DENSITY=1.
# REGIME: default, or collapse: "--lr 1e-3 --beta 0" before GRPO_ARGS, where the demo's GRPO hacks its RM (one
# template answer for every prompt); recorded in the report.
# EXPERIMENT=density: SEEDS (default 0..4) each run the whole pipeline in $NANOCHAT_BASE_DIR/experiment/seed_<s>
# (experiment_collapse/ for REGIME=collapse) with ARMS (uniform and the arms it is compared with; default
# "uniform density", "uniform density kl_0.2" for REGIME=collapse) and EXPERIMENT_RM_STEPS (default 60), then
# scripts.kat_experiment_report writes experiment.md/json there, comparing each arm of ARMS with uniform
# (dpo_density with dpo: ARMS="uniform dpo dpo_density" asks the question in its DPO form). With MODEL: each seed in
# $NANOCHAT_BASE_DIR/experiment_<MODEL>/seed_<s> runs TASK=word_arithmetic_skewed with ARMS="dpo dpo_density" (the model
# converted once, MODEL_DIR, for every seed), and the report compares dpo_density with dpo per kind of question; with
# ARMS="uniform density" (the GRPO form, in experiment_<MODEL>_grpo/) TASK=word_arithmetic_gap, GRPO with the task's
# reward uniform and density-weighted, density compared with uniform. OWN_PAIRS=1 (with MODEL, DPO arms): the pairs in the
# model's own words (stage own_pairs, scripts.kat_own_pairs: 8 samples of each training question, the best chosen over
# the worst where the task's reward tells them apart), on word_arithmetic_gap, in experiment_<MODEL>_own/.
set -euo pipefail
cd "$(dirname "$0")"
case ${EXPERIMENT:-} in  # before anything is made
    ""|density) ;;
    *) echo "speedrun: unknown EXPERIMENT '$EXPERIMENT' (density, or unset for the pipeline)" >&2; exit 2 ;;
esac
case ${OWN_PAIRS:-0} in
    0) ;;
    1) [ -n "${MODEL:-}" ] || { echo "speedrun: OWN_PAIRS=1 needs MODEL (pairs in a real model's own words)" >&2; exit 2; } ;;
    *) echo "speedrun: OWN_PAIRS is 0 or 1, got '$OWN_PAIRS'" >&2; exit 2 ;;
esac
source scripts/setup_env.sh

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
B=$NANOCHAT_BASE_DIR
if [ -z "${NPROC_PER_NODE:-}" ]; then  # one rank per GPU, else 2 on CPU (asking torch takes 2 s: only if not given)
    GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
    NPROC_PER_NODE=$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)
    # A real model on CPU: one rank on every core. Two gloo ranks of one thread each take twice as long a GRPO
    # step on SmolLM2 (8.3 s against 3.9 s on 2 cores): each rank reads its own copy of the weights to decode, and
    # the gradients' all-reduce moves 0.5 GB a step.
    if [ -n "${MODEL:-}" ] && [ "$GPUS" = 0 ]; then NPROC_PER_NODE=1; export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"; fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export NPROC_PER_NODE  # the experiment's per-seed runs take it as given
MAX_RESTARTS="${MAX_RESTARTS:-1}"
FORCE="${FORCE:-0}"
REGIME="${REGIME:-default}"
case $REGIME in
    default) REGIME_GRPO="" ;;
    # The demo's GRPO collapses when its step is large and nothing holds it near the SFT policy: it finds one
    # template of dense-topic words the RM likes and answers every prompt with it (reward hacking).
    collapse) REGIME_GRPO="--lr 1e-3 --beta 0" ;;
    *) echo "speedrun: unknown REGIME '$REGIME' (default, collapse)" >&2; exit 2 ;;
esac
EXPERIMENT_SFT_STEPS="${SFT_STEPS:-400}"  # the density experiment's (it has no arithmetic topic)
SEED="${SEED:-0}"
SAVE_EVERY="${SAVE_EVERY:-50}"  # every stage checkpoints this often, so an interrupted one resumes near where it was
model_arms() {  # with MODEL: GRPO with the task's reward (uniform, the default; density: each prompt its density
    # weight), or DPO arms on the task's pairs
    case " $1 " in " uniform "|" density "|" uniform density "|" density uniform "|" dpo "|" dpo_density "|" dpo dpo_density "|" dpo_density dpo ") ;;
        *) echo "speedrun: with MODEL, ARMS is uniform and/or density (GRPO with the task's reward; uniform the default) or dpo and/or dpo_density" >&2
           exit 2 ;; esac
    [[ "${OWN_PAIRS:-0}" != 1 || " $1 " == *" dpo"* ]] ||
        { echo "speedrun: OWN_PAIRS=1 makes pairs for DPO arms: ARMS=\"dpo dpo_density\"" >&2; exit 2; }
}
fetch_model() {  # the converted model's dir (MODEL_DIR, else $NANOCHAT_BASE_DIR/models/<name>), made on the first run
    python -m scripts.kat_fetch_model --model "$MODEL" ${MODEL_DIR:+--out "$MODEL_DIR"} | tee /dev/stderr | tail -n 1
}
check_arms() {  # before any stage runs: a bad arm would otherwise stop the pipeline after SFT and the RMs
    for arm in $1; do
        [[ $arm =~ ^(uniform|density|fork|dpo|dpo_density|kl_[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?)$ ]] ||
            { echo "speedrun: unknown arm '$arm' in ARMS (uniform, density, fork, dpo, dpo_density, kl_<beta> such as kl_0.2)" >&2; exit 2; }
    done
}
read -r -a EXTRA_SFT <<< "${SFT_ARGS:-}"
read -r -a EXTRA_RM <<< "${RM_ARGS:-}"
read -r -a EXTRA_GRPO <<< "$REGIME_GRPO ${GRPO_ARGS:-}"  # the regime's first: yours win
read -r -a EXTRA_DPO <<< "${DPO_ARGS:-}"
read -r -a EXTRA_EVAL <<< "${EVAL_ARGS:-}"
read -r -a EXTRA_OWN_PAIRS <<< "${OWN_PAIRS_ARGS:-}"
RUNTIME=()  # flags every stage that runs models takes
[ -n "${BACKEND:-}" ] && RUNTIME+=(--backend "$BACKEND")
[ -n "${NANOCHAT_VINTAGE:-}" ] && RUNTIME+=(--nanochat_vintage "$NANOCHAT_VINTAGE")
mkdir -p "$B"
t_start=$SECONDS

if [ "${EXPERIMENT:-}" = density ]; then  # each seed's run applies REGIME itself
    if [ -n "${MODEL:-}" ]; then  # the DPO form (the default) or the GRPO form (ARMS="uniform density"), each its root
        ARMS="${ARMS:-dpo dpo_density}"
        ROOT="$B/experiment_$MODEL$([[ " $ARMS " == *" dpo"* ]] || echo _grpo)$([ "${OWN_PAIRS:-0}" != 1 ] || echo _own)"
    elif [ "$REGIME" = default ]; then ROOT="$B/experiment"; ARMS="${ARMS:-uniform density}"
    else ROOT="$B/experiment_$REGIME"; ARMS="${ARMS:-uniform density kl_0.2}"; fi
    check_arms "$ARMS"
    if [ -n "${MODEL:-}" ]; then  # the real model's form: its task reward judges, so no RM
        [[ " $ARMS " == *" dpo_density "* || " $ARMS " == *" density "* ]] ||
            { echo "speedrun: with MODEL the experiment's arms are dpo dpo_density, or uniform density (GRPO)" >&2; exit 2; }
        model_arms "$ARMS"
    fi
    [[ -n "${MODEL:-}" || " $ARMS " == *" uniform "* ]] ||
        { echo "speedrun: the experiment compares each arm with uniform: add it to ARMS" >&2; exit 2; }
    [[ " $ARMS " != *" dpo_density "* || " $ARMS " == *" dpo "* ]] ||
        { echo "speedrun: the experiment compares dpo_density with dpo: add it to ARMS" >&2; exit 2; }
    [[ " $ARMS " != *" density "* || " $ARMS " == *" uniform "* ]] ||
        { echo "speedrun: the experiment compares density with uniform: add it to ARMS" >&2; exit 2; }
    if [ -n "${MODEL:-}" ]; then
        echo "== fetch_model"
        MODEL_DIR=$(fetch_model)
        export MODEL_DIR  # one copy for every seed
    fi
    SEEDS="${SEEDS:-0 1 2 3 4}"
    for seed in $SEEDS; do  # finished stages are skipped and interrupted ones resume, per seed and arm
        echo "== experiment: seed $seed"
        if [ -n "${MODEL:-}" ]; then  # the real model's task skewed; both arms; per-kind held-out accuracy. DPO: rare
            # the kinds of Result 4 (docs/density.md); GRPO: rare the kinds the model is behind on (Result 5)
            # (OWN_PAIRS=1: DPO on the GRPO form's skew)
            task=word_arithmetic_gap; [[ " $ARMS " == *" dpo"* && "${OWN_PAIRS:-0}" != 1 ]] && task=word_arithmetic_skewed
            EXPERIMENT= NANOCHAT_BASE_DIR="$ROOT/seed_$seed" SEED="$seed" ARMS="$ARMS" TASK=$task \
                bash "$PWD/speedrun.sh" || { echo "speedrun: experiment seed $seed failed" >&2; exit 1; }
            continue
        fi
        # RM_STEPS 60 (the demo's is 150): a budget at which a uniform RM is still measurably worse on rare
        # topics, so weighting has something to fix; the report checks that gap per seed.
        # No arithmetic topic and its longer SFT: the experiment is about the eight chat topics' density.
        EXPERIMENT= NANOCHAT_BASE_DIR="$ROOT/seed_$seed" SEED="$seed" ARMS="$ARMS" REGIME="$REGIME" \
            RM_STEPS="${EXPERIMENT_RM_STEPS:-60}" SFT_STEPS="$EXPERIMENT_SFT_STEPS" \
            DEMO_ARGS="--n_arithmetic 0 ${DEMO_ARGS:-}" \
            bash "$PWD/speedrun.sh" || { echo "speedrun: experiment seed $seed failed" >&2; exit 1; }
    done
    # shellcheck disable=SC2086
    python -m scripts.kat_experiment_report --root "$ROOT" --seeds $SEEDS --arms $ARMS
    echo "== experiment finished in $((SECONDS - t_start)) s; report: $ROOT/experiment.md"
    exit 0
fi
ARMS="${ARMS:-$([ "${DENSITY:-0}" = 1 ] && echo density || echo uniform)}"
check_arms "$ARMS"
DEMO=$([ -z "${MODEL:-}" ] && { [ -z "${BACKBONE:-}" ] || [ -z "${PAIRS:-}" ]; } && echo 1 || echo 0)
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
steps() { [ -n "$1" ] && echo "--max_steps $1"; true; }  # a stage's --max_steps where *_STEPS is set
read -r -a STEPS_SFT <<< "$(steps "${SFT_STEPS:-}")"
read -r -a STEPS_RM <<< "$(steps "${RM_STEPS:-}")"
read -r -a STEPS_GRPO <<< "$(steps "${GRPO_STEPS:-}")"
read -r -a STEPS_DPO <<< "$(steps "${DPO_STEPS:-}")"
read -r -a SAMPLES <<< "${EVAL_SAMPLES:+--samples $EVAL_SAMPLES}"
export REGIME SFT_STEPS RM_STEPS GRPO_STEPS DPO_STEPS EVAL_SAMPLES
# For the report: the regime and what was passed through, for the stages this run has
ran=(REGIME EVAL_SAMPLES EVAL_ARGS)
[[ " $ARMS " == *" dpo"* && -n "${MODEL:-}" ]] || ran+=(GRPO_STEPS GRPO_ARGS)  # with MODEL the DPO arms replace GRPO
[ "$DEMO" = 1 ] && ran+=(SFT_STEPS SFT_ARGS)
[ -n "${MODEL:-}" ] && ran+=(MODEL TASK)
[ "${OWN_PAIRS:-0}" = 1 ] && ran+=(OWN_PAIRS OWN_PAIRS_ARGS)
[ -n "${MODEL:-}" ] && [ "${TASK:-}" = multiplication ] && ran+=(SFT_STEPS SFT_ARGS)
[ -z "${MODEL:-}" ] && ran+=(RM_STEPS RM_ARGS)
[[ " $ARMS " == *" dpo"* ]] && ran+=(DPO_STEPS DPO_ARGS)
python -c 'import json, os, sys; json.dump({k: os.environ.get(k, "") for k in sys.argv[2:]}, open(sys.argv[1], "w"))' \
    "$B/stage_args.json" "${ran[@]}"

record() {  # record FILE STAGE VALUE: one line per stage in FILE, the latest run's
    { grep -v "^$2	" "$B/$1" 2>/dev/null || true; printf '%s\t%s\n' "$2" "$3"; } > "$B/$1.tmp"
    mv "$B/$1.tmp" "$B/$1"
}
record_time() { record timings.tsv "$1" "$2"; }  # stage seconds
skip() { [ "$FORCE" != 1 ] && [ -e "$1" ]; }
# launch NAME NEEDS SCRIPT ARGS...: one torchrun stage (one rank: the script itself, which needs no launcher and
# starts ~3 s sooner without torchrun's agent). On failure it repeats the stage's last `error:` line after
# torchrun's summary, then says what the stage needed and which stage makes it.
launch() {
    local name=$1 needs=$2 script=$3 errlog err cmd; shift 3
    if [ "$NPROC_PER_NODE" = 1 ]; then cmd=(python -m "$script")
    else cmd=(torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS"
              -m "$script" --); fi
    echo "   $name: python -m $script $* ${RUNTIME[*]}"
    record stages.tsv "$name" "python -m $script $* ${RUNTIME[*]}"  # the report lists each stage's command
    errlog=$(mktemp)
    # stderr goes to the terminal and, through tee, to errlog; stdout is untouched
    if ! { "${cmd[@]}" "$@" "${RUNTIME[@]}" 2>&1 1>&3 | tee "$errlog" >&2; } 3>&1; then
        err=$(grep -a '^error: ' "$errlog" | tail -n 1 || true)
        rm -f "$errlog"
        echo "speedrun: stage $name failed${err:+: ${err#error: }}" >&2
        echo "speedrun: stage $name needs $needs" >&2
        exit 1
    fi
    rm -f "$errlog"
}
# train NAME NEEDS DIR SCRIPT ARGS...: skipped when DIR/.complete exists, resumed when DIR has a
# complete checkpoint (a meta_<N>.json: written last).
train() {
    local name=$1 needs=$2 dir=$3 script=$4; shift 4
    if skip "$dir/.complete"; then echo "== $name: skipped (done: $dir)"; return; fi
    local resume=()
    if [ "$FORCE" != 1 ] && ls "$dir"/meta_*.json >/dev/null 2>&1; then resume=(--resume latest); fi
    [ "$FORCE" = 1 ] && rm -rf "$dir"
    echo "== $name ($NPROC_PER_NODE ranks)${resume:+, resuming}"
    local s=$SECONDS
    launch "$name" "$needs" "$script" "$@" --out "$dir" "${resume[@]}"
    touch "$dir/.complete"
    record_time "$name" $((SECONDS - s))
}

# density NAME BACKBONE PAIRS OUT FLAGS...: the density weights of PAIRS' prompts in BACKBONE's embeddings, skipped when
# OUT exists
density() {
    local name=$1 backbone=$2 pairs=$3 out=$4 s=$SECONDS; shift 4
    if skip "$out"; then echo "== $name: skipped (done: $out)"; return; fi
    echo "== $name ($NPROC_PER_NODE ranks)"
    mkdir -p "$(dirname "$out")" && rm -f "$out"  # FORCE=1: made again (the script refuses to overwrite)
    launch "$name" "a backbone ($backbone) and pairs ($pairs)" scripts.kat_compute_density --backbone "$backbone" \
        --pairs "$pairs" --out "$out" "$@"
    record_time "$name" $((SECONDS - s))
}

arm_dir() { case $1 in dpo*) echo "$B/dpo_checkpoints/$1" ;; *) echo "$B/chatrl_checkpoints/$1" ;; esac; }
WEIGHTS="$B/density/weights.jsonl" FORK_WEIGHTS="$B/density/fork_weights.jsonl"
EVAL_POLICIES=()
# dpo_arm ARM POLICY PAIRS FLAGS...: DPO of POLICY on PAIRS (dpo_density: each pair its density weight, $WEIGHTS), the
# policy added to EVAL_POLICIES
dpo_arm() {
    local arm=$1 policy=$2 pairs=$3 weights=(); shift 3
    [ "$arm" = dpo_density ] && weights=(--density "$WEIGHTS")
    train "$arm" "the policy $policy and pairs ($pairs)${weights:+ and density weights (made by the density stage)}" \
        "$(arm_dir "$arm")" scripts.kat_train_dpo --policy "$policy" --pairs "$pairs" "$@" "${weights[@]}" "${EXTRA_DPO[@]}"
    EVAL_POLICIES+=(--policy "DPO $([ "$arm" = dpo ] && echo uniform || echo density)=$(arm_dir "$arm")")
}

eval_fresh() {  # eval_fresh DIR...: the report is newer than the policy trained in every DIR
    local dir
    skip "$B/report.md" || return 1
    for dir in "$@"; do [ "$B/report.md" -nt "$dir/.complete" ] || return 1; done
}

trained_tokens() {  # trained_tokens DIR: "--max_new_tokens N" of the GRPO policy in DIR, as its newest checkpoint records it
    python -c 'import json, pathlib, sys
m = max(pathlib.Path(sys.argv[1]).glob("meta_*.json"), key=lambda p: int(p.stem.split("_")[1]))
print("--max_new_tokens", json.loads(m.read_text())["args"]["max_new_tokens"])' "$1"
}

# ---- MODEL: a real pretrained model on a verifiable task --------------------------------------------
# No reward model here: the task's reward checks the answer itself, which an RM learned from pairs would only
# approximate. GRPO with that reward (or, with ARMS="dpo dpo_density", DPO on the task's pairs: the density
# experiment's arms), then the report: held-out accuracy before and after, greedy and sampled (per kind of question),
# and the learning curve against training seconds.
if [ -n "${MODEL:-}" ]; then
    [ "$MODEL" = smollm2 ] || { echo "speedrun: unknown MODEL '$MODEL' (smollm2)" >&2; exit 2; }
    TASK="${TASK:-word_arithmetic}"
    case "$TASK" in word_arithmetic|word_arithmetic_skewed|word_arithmetic_gap|multiplication) TASK_REWARD=last_number ;;
        code_functions) TASK_REWARD=nanochat_ext.tasks.code_tests:passes ;;  # its tests, run sealed: one attempt
        *) echo "speedrun: unknown TASK '$TASK' (word_arithmetic, word_arithmetic_skewed, word_arithmetic_gap, multiplication, code_functions)" >&2
           exit 2 ;; esac
    model_arms "$ARMS"
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
        read -r -a TOKENS <<< "$(trained_tokens "$dir")"
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
    python - "$B/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, p in r["policies"].items():
    print(f"  policy {name}: held-out accuracy greedy {p['task_accuracy_greedy']:.3f}, "
          f"sampled {p['task_accuracy_sampled']:.3f}; e.g. {p['examples'][0]['prompt']!r} -> {p['examples'][0]['completion']!r}")
PY
    exit 0
fi

# ---- demo stages: only when no real backbone and pairs are given ----------------------------------
if [ -z "${BACKBONE:-}" ] || [ -z "${PAIRS:-}" ]; then
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
eval_tokens() {  # the first GRPO arm's --max_new_tokens (the demo's 16 where no arm is GRPO)
    local arm
    for arm in $ARMS; do case $arm in dpo*) ;; *) trained_tokens "$(arm_dir "$arm")"; return ;; esac; done
    [ "$DEMO" = 1 ] && echo "--max_new_tokens 16"
    true
}
TRAINED=()
for arm in $ARMS; do TRAINED+=("$(arm_dir "$arm")"); done
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
python - "$B/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for d, m in r["reward_models"].items():
    print(f"  rm {d.rsplit('/', 1)[-1]}: held-out accuracy {m['overall']['accuracy']:.3f}")
for name, p in r["policies"].items():
    acc = p["task_accuracy_sampled"]
    print(f"  policy {name}: task accuracy (sampled) {'-' if acc is None else f'{acc:.3f}'}, "
          f"RM score (sampled) {p['rm_score_sampled']:.3f}, distinct-2 {p['distinct_2']:.3f}")
    if p.get("tool_use"):
        t = p["tool_use"]
        print(f"  policy {name}: arithmetic accuracy with the calculator {t['accuracy_with_tools']:.3f}, without "
              f"{t['accuracy_without_tools']:.3f}; {t['tool_calls']:.2f} calls per completion, "
              f"{t['tool_errors']:.3f} refused")
PY
