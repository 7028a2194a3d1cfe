#!/usr/bin/env bash
# Two trees' speed in one sitting: OLD and NEW (any commits) exported side by side, the project's benches run on one
# tree then the other, the order flipped every round, ROUNDS rounds (at least 3, and even, so each tree goes first as
# often: on these shared 2-core machines two runs of the same tree differ by 10-15% within a sitting, so one pair of
# runs proves nothing). Every run is a JSON line in $OUT (made anew), its output in $WORK/logs; the table at the end
# gives each figure's median over the rounds with its range, per tree, and NEW / OLD. A run that fails stops the
# sitting with a line naming it and its log.
#
#   bash bench/ab.sh 6b04eaa HEAD                       # ROUNDS=4 BENCHES="grpo rm dpo smollm2_grpo"
#   ROUNDS=5 BENCHES="grpo" bash bench/ab.sh main my-branch
#
# Benches (each tree runs its own bench/ scripts on the same assets, with the same .venv):
#   grpo          GRPO on the tiny Llama (bench/make_assets.py), 1 process x 2 threads: completions/s
#   rm, dpo       the reward model (full fine-tune) and DPO on the same model: pairs/s
#   smollm2_grpo  GRPO on SmolLM2-135M-Instruct's shape (its config, random weights: bench/model_shape.py), 8 steps:
#                 completions/s; where $SMOLLM2 (a converted model dir, `python -m scripts.kat_fetch_model`) is there
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bash bench/ab.sh OLD NEW" >&2; exit 2; }
OLD_REV=$1 NEW_REV=$2
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/setup_env.sh
ROUNDS=${ROUNDS:-4}
BENCHES=${BENCHES:-grpo rm dpo smollm2_grpo}
WORK=${WORK:-/tmp/nanochat_ab}
OUT=${OUT:-$ROOT/bench/results/ab_$(date +%F)_$(git rev-parse --short "$1")_$(git rev-parse --short "$2").jsonl}
SMOLLM2=${SMOLLM2:-${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}/models/smollm2-135m-instruct}
[ "$ROUNDS" -ge 3 ] || echo "ab: ROUNDS=$ROUNDS: fewer than 3 rounds cannot tell a change from the machine's noise" >&2
[ $((ROUNDS % 2)) = 0 ] || echo "ab: ROUNDS=$ROUNDS is odd: OLD goes first once more than NEW" >&2

rm -rf "$WORK" && mkdir -p "$WORK/logs" "$(dirname "$OUT")" && : > "$OUT"  # this sitting's runs alone
for side in old new; do  # each tree as committed, nothing of this work tree's
  rev=$([ $side = old ] && echo "$1" || echo "$2")
  mkdir "$WORK/$side" && git archive "$rev" | tar -x -C "$WORK/$side"
done
A=$WORK/assets
python bench/make_assets.py --out "$A" >/dev/null
if [[ " $BENCHES " == *" smollm2_grpo "* ]]; then
  if [ -f "$SMOLLM2/config.json" ]; then
    python bench/model_shape.py strip "$SMOLLM2" "$WORK/smollm2_shape"
    python bench/model_shape.py fill "$WORK/smollm2_shape" "$WORK/smollm2" >/dev/null
  else
    echo "ab: no $SMOLLM2 (python -m scripts.kat_fetch_model makes it): smollm2_grpo left out" >&2
    BENCHES=${BENCHES//smollm2_grpo/}
  fi
fi

run() {  # run TREE BENCH: the bench's JSON line from that tree's own scripts, tagged
  local tree=$1 bench=$2 cmd
  case $bench in
    grpo) cmd=(bench/bench_grpo.py --policy "$A/tiny-llama" --prompts "$A/prompts.jsonl" --threads 2) ;;
    rm) cmd=(bench/bench_rm.py --backbone "$A/tiny-llama" --pairs "$A/pairs.jsonl" --threads 2 --unfreeze_last all) ;;
    dpo) cmd=(bench/bench_rm.py --trainer dpo --backbone "$A/tiny-llama" --pairs "$A/pairs.jsonl" --threads 2) ;;
    smollm2_grpo) cmd=(bench/bench_grpo.py --policy "$WORK/smollm2" --prompts "$A/prompts.jsonl" --threads 2
                       --steps 8 --warmup 2 --new_tokens 16) ;;
    *) echo "ab: unknown bench $bench" >&2; exit 2 ;;
  esac
  local log="$WORK/logs/${bench}_${tree}_round$3.log" line
  if ! (cd "$WORK/$tree" && PYTHONPATH="$WORK/$tree" python "${cmd[@]}") > "$log" 2>&1 ||
      ! line=$(tail -1 "$log" | python -c "import json,sys; r=json.loads(sys.stdin.read()); r.update(tree='$tree', ab_bench='$bench', round=$3); print(json.dumps(r))" 2>/dev/null); then
    echo "ab: $bench on $tree ($( [ $tree = old ] && echo "$OLD_REV" || echo "$NEW_REV"), round $3) failed: see $log" >&2
    exit 1
  fi
  echo "$line" >> "$OUT"
}

echo "ab: $1 (old) against $2 (new), $ROUNDS rounds of: $BENCHES; runs in $OUT" >&2
for round in $(seq "$ROUNDS"); do
  order=$([ $((round % 2)) = 1 ] && echo "old new" || echo "new old")  # flipped each round
  for bench in $BENCHES; do
    for tree in $order; do run "$tree" "$bench" "$round"; done
  done
done
python bench/ab_table.py "$OUT" "$1" "$2"
