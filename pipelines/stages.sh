# Sourced by speedrun.sh and pipelines/*.sh: the pipeline's settings (from the environment) and its stage functions.
#
# Knobs: NPROC_PER_NODE (default: GPUs, else 2 gloo ranks), MAX_RESTARTS (torchrun restarts a stage that lost a rank
# this many times, each resuming from the stage's newest checkpoint; default 1; one rank runs without torchrun),
# SFT_STEPS, RM_STEPS, GRPO_STEPS, DPO_STEPS, EVAL_SAMPLES, SEED (data and training), SAVE_EVERY, FORCE=1 (re-run
# every stage), BACKEND (process-group backend for every stage, e.g. nccl; default nccl on GPUs, gloo on CPU; the
# tests run cuda:gloo on CPU, a gloo group that serves only CUDA tensors, to hold the CPU pipeline to NCCL's device
# rule), NANOCHAT_VINTAGE (feb2026 or mar2026a, only for a March-2026 checkpoint whose vintage cannot be told).
# SFT_ARGS, RM_ARGS, GRPO_ARGS, DPO_ARGS, EVAL_ARGS, OWN_PAIRS_ARGS: more flags for that stage's script (split on
# spaces), after the stage's own, so the last copy of a flag wins (e.g. GRPO_ARGS="--lr 1e-3 --beta 0"; a kl_<beta>
# arm's --beta comes after them); each stage's meta records its args, the report these strings, REGIME and the step
# counts. --out and --resume stay the pipeline's. A finished stage is skipped whatever these say: change them in a
# new NANOCHAT_BASE_DIR, or re-run with FORCE=1.
# REGIME: default, or collapse: "--lr 1e-3 --beta 0" before GRPO_ARGS, where the demo's GRPO hacks its RM (one
# template answer for every prompt); recorded in the report.
CDPATH="" cd -- "$(dirname "${BASH_SOURCE[0]}")/.."
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
# ARMS: GRPO arms, each against its RM: uniform, density (the inverse-density-weighted RM) and fork (an RM with the
# fork's 1/kNN-distance weighting, which favours dense prompts); kl_<beta> (e.g. kl_0.05): the uniform RM with
# --beta <beta>, a control that fights collapse with the KL term instead of the RM; dpo: DPO of the SFT policy on the
# pairs themselves, no RM; dpo_density: the same with each pair's density weight (as the density RM's); default:
# uniform, or density with DENSITY=1. With MODEL: uniform and/or density (GRPO with the task's reward), or DPO arms.
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

# stage_flags: each stage's --max_steps (where *_STEPS is set) and the evaluation's --samples, and what the report
# records of the run's settings (stage_args.json), for the stages this run has. The demo's recipe sets its own first.
stage_flags() {
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
    python -m scripts.kat_pipeline stage_args "$B/stage_args.json" "${ran[@]}"
}

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

max_new_tokens() { python -m scripts.kat_pipeline max_new_tokens "$1"; }  # "--max_new_tokens N" trained in DIR $1
eval_tokens() {  # the first GRPO arm's --max_new_tokens (the demo's 16 where no arm is GRPO)
    local arm
    for arm in $ARMS; do case $arm in dpo*) ;; *) max_new_tokens "$(arm_dir "$arm")"; return ;; esac; done
    [ "$DEMO" = 1 ] && echo "--max_new_tokens 16"
    true
}
