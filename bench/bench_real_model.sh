#!/usr/bin/env bash
# Ours beside TRL on a real model and a verifiable task, in one sitting (issue #50): first GRPO throughput, REPEATS
# runs a side, alternating which side goes first (ours: bench/bench_grpo.py; TRL: bench/trl_real_model.py --mode
# throughput; both 1 prompt x 8 completions of exactly 32 tokens, beta 0.04, lr 1e-6, fp32, on the task's training
# prompts through the model's chat template); then time to held-out greedy accuracy, ours then TRL's
# (bench/ours_real_model.py: kat_train_grpo with speedrun.sh's MODEL=smollm2 recipe; bench/trl_real_model.py --mode
# time_to_accuracy: TRL set to the same recipe). JSON lines, each tagged with its run, repeat and the sitting's
# start, are appended to OUT; then the reward model's pairs/s, REPEATS runs a side, alternating (ours:
# bench/bench_rm.py --unfreeze_last all; TRL: bench/trl_real_rm.py's RewardTrainer; both a full fine-tune on the
# task's pairs.jsonl, RM_PAIRS pairs a step, max length 128, fp32, AdamW lr 1e-4, grad clip 1). The table
# (bench/real_model_table.py) is printed at the end. PARTS (default "grpo accuracy rm": GRPO throughput, time to
# accuracy, the RM) runs some parts alone.
#
#   bash bench/bench_real_model.sh MODEL_DIR TASK_DIR [OUT.jsonl]
#   MODEL_DIR: python -m scripts.kat_fetch_model --model smollm2 | tail -n 1
#   TASK_DIR:  python -m scripts.kat_task_data --out TASK_DIR  (train, eval and pairs)
#
# Knobs: PARTS, GRPO_DTYPE (float32, or bfloat16: GRPO throughput in bf16 as RM_DTYPE below), RM_PAIRS (8), RM_STEPS
# (20: RM steps a run, TPUT_WARMUP of them untimed), RM_DTYPE (float32, or bfloat16: ours --dtype bfloat16, TRL's bf16
# mixed precision, for a CPU that computes bf16 natively), STEPS (time-to-accuracy steps, 40), EVAL_EVERY (10), REPEATS
# (throughput runs a side, 3), TPUT_STEPS (40) and TPUT_WARMUP (5: left out of the timing), THREADS (torch threads of
# each run, 2), SEED (0),
# TRL_PY (/tmp/anchor-venv/bin/python: TRL 1.16, ../shared/anchor-bench/README.md). Default OUT:
# bench/results/real_model_<date>.jsonl; both trainers' logs go to OUT with .log for .jsonl.
#
# What still differs between the sides (everything else is set equal, see bench/trl_real_model.py's SETTINGS):
# - data order and random streams: TRL's shuffled RepeatSampler and torch generator vs our loader and per-prompt
#   seeds; the same --seed draws different prompts and samples.
# - decoding: our engine (KV cache, a group's prompt shared) vs transformers' generate(); training forward: ours shares
#   a group's prompt (prefix tree) and checks steps for non-finite values, TRL pads each row; same maths.
# - evaluation: ours measures greedy and sampled accuracy (both left out of the seconds), TRL's callback greedy only;
#   our step 0 comes from evaluate_rewards (what kat_train_grpo's evaluations call) on a separately loaded copy.
# - the clock: ours is perf/train_time_s (from the loop's start, after loading and the optimizer; logging included,
#   the final checkpoint's write not); TRL's from on_train_begin to each step's end, less the callback's evaluations.
# - throughput's reward: bench_grpo.py scores exact_match, TRL last_number; lengths are fixed, so only scoring (well
#   under a ms a step) differs.
set -eEuo pipefail  # E: the ERR trap fires inside functions too
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
    echo "usage: bash bench/bench_real_model.sh MODEL_DIR TASK_DIR [OUT.jsonl]" >&2; exit 2
fi
[ -f "$1/config.json" ] || { echo "error: $1: no config.json (a Hugging Face model dir)" >&2; exit 2; }
for f in train.jsonl eval.jsonl pairs.jsonl; do
    [ -f "$2/$f" ] || { echo "error: $2: no $f (python -m scripts.kat_task_data --out DIR writes them)" >&2; exit 2; }
done
MODEL_DIR=$(cd "$1" && pwd)
TASK_DIR=$(cd "$2" && pwd)
if [ $# -eq 3 ]; then
    mkdir -p "$(dirname "$3")"
    OUT="$(cd "$(dirname "$3")" && pwd)/$(basename "$3")"
fi
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
OUT=${OUT:-$PWD/bench/results/real_model_$(date +%F).jsonl}
LOG="${OUT%.jsonl}.log"
STEPS=${STEPS:-40} EVAL_EVERY=${EVAL_EVERY:-10} REPEATS=${REPEATS:-3} TPUT_STEPS=${TPUT_STEPS:-40}
TPUT_WARMUP=${TPUT_WARMUP:-5} THREADS=${THREADS:-2} SEED=${SEED:-0} TRL_PY=${TRL_PY:-/tmp/anchor-venv/bin/python}
PARTS=${PARTS:-grpo accuracy rm} GRPO_DTYPE=${GRPO_DTYPE:-float32}
RM_PAIRS=${RM_PAIRS:-8} RM_STEPS=${RM_STEPS:-20} RM_DTYPE=${RM_DTYPE:-float32}
"$TRL_PY" -c "import trl" 2>/dev/null || { echo "error: TRL_PY=$TRL_PY does not import trl" >&2; exit 2; }
SITTING=$(date +%Y-%m-%dT%H:%M:%S)
trap 'echo "error: a run failed; its output is at the end of $LOG" >&2' ERR

# stdin's JSON records (lines that parse to an object with "bench"), tagged, appended to OUT; one progress line.
tag() {
    python -c '
import json, sys
run, repeat, sitting, out = sys.argv[1:]
records = []
for line in sys.stdin:
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        continue  # the trainers print other lines too (TRL its train() summary)
    if isinstance(r, dict) and "bench" in r:
        records.append({**r, "run": run, "repeat": int(repeat), "sitting": sitting})
if not records:
    sys.exit(f"error: {run}: no JSON record on its stdout")
with open(out, "a") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
last = records[-1]
if "completions_per_s" in last:
    said = "%s completions/s" % last["completions_per_s"]
elif "pairs_per_s" in last:
    said = "%s pairs/s" % last["pairs_per_s"]
else:
    said = "greedy accuracy %.3f after %d steps, %.1f s" % (last["final_greedy_accuracy"], last["steps"],
                                                             last["train_s"])
print("== %s %s: %s" % (run, repeat, said), flush=True)
' "$1" "$2" "$SITTING" "$OUT"
}
run() {  # run NAME REPEAT CMD...: CMD's stderr to the log, its records to OUT
    echo "== $1 $2: ${*:3}" >>"$LOG"
    "${@:3}" 2>>"$LOG" | tee -a "$LOG" | tag "$1" "$2"
}
ours_throughput() {
    run ours_throughput "$1" python bench/bench_grpo.py --policy "$MODEL_DIR" --prompts "$TASK_DIR/train.jsonl" \
        --threads "$THREADS" --steps "$TPUT_STEPS" --warmup "$TPUT_WARMUP" --dtype "$GRPO_DTYPE"
}
trl_throughput() {
    run trl_throughput "$1" "$TRL_PY" bench/trl_real_model.py --mode throughput --model "$MODEL_DIR" \
        --task "$TASK_DIR" --threads "$THREADS" --steps "$TPUT_STEPS" --warmup "$TPUT_WARMUP" --seed "$SEED" \
        $([ "$GRPO_DTYPE" = bfloat16 ] && echo --bf16)
}

ours_rm() {
    run ours_rm "$1" python bench/bench_rm.py --backbone "$MODEL_DIR" --pairs "$TASK_DIR/pairs.jsonl" \
        --unfreeze_last all --pairs_per_proc "$RM_PAIRS" --threads "$THREADS" --steps "$RM_STEPS" --warmup "$TPUT_WARMUP" \
        --dtype "$RM_DTYPE"
}
trl_rm() {
    run trl_rm "$1" "$TRL_PY" bench/trl_real_rm.py --model "$MODEL_DIR" --task "$TASK_DIR" --pairs "$RM_PAIRS" \
        --threads "$THREADS" --steps "$RM_STEPS" --warmup "$TPUT_WARMUP" --seed "$SEED" \
        $([ "$RM_DTYPE" = bfloat16 ] && echo --bf16)
}
alternate() {  # alternate OURS TRL: REPEATS runs a side, which side goes first alternating, so that a drift of the
    for r in $(seq "$REPEATS"); do  # machine falls on both
        if [ $((r % 2)) -eq 1 ]; then "$1" "$r"; "$2" "$r"; else "$2" "$r"; "$1" "$r"; fi
    done
}

echo "sitting $SITTING: $MODEL_DIR on $TASK_DIR -> $OUT (logs: $LOG); parts: $PARTS"
[[ " $PARTS " == *" grpo "* ]] && alternate ours_throughput trl_throughput
if [[ " $PARTS " == *" accuracy "* ]]; then
    run ours_time_to_accuracy 1 python bench/ours_real_model.py --model "$MODEL_DIR" --task "$TASK_DIR" \
        --steps "$STEPS" --eval_every "$EVAL_EVERY" --threads "$THREADS" --seed "$SEED"
    run trl_time_to_accuracy 1 "$TRL_PY" bench/trl_real_model.py --mode time_to_accuracy --model "$MODEL_DIR" \
        --task "$TASK_DIR" --steps "$STEPS" --eval_every "$EVAL_EVERY" --threads "$THREADS" --seed "$SEED"
fi
[[ " $PARTS " == *" rm "* ]] && alternate ours_rm trl_rm
echo
python bench/real_model_table.py "$OUT"
