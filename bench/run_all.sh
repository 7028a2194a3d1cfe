#!/usr/bin/env bash
# Ours beside Hugging Face TRL (../shared/anchor-bench) in one sitting, interleaved, ROUNDS times;
# one JSON line per run on stdout, tagged with "run". Machines are noisy: compare within a sitting.
#   ANCHOR_VENV=/tmp/anchor-venv ANCHOR_ASSETS=/tmp/anchor-assets ROUNDS=2 bash bench/run_all.sh
# From a clone with no ../shared/anchor-bench (or no TRL venv): the assets from bench/make_assets.py, ours only.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/setup_env.sh
ANCHOR=${ANCHOR:-../shared/anchor-bench}
ANCHOR_VENV=${ANCHOR_VENV:-/tmp/anchor-venv}
export ANCHOR_ASSETS=${ANCHOR_ASSETS:-/tmp/anchor-assets}
ROUNDS=${ROUNDS:-1}
A=$ANCHOR_ASSETS
HAVE_TRL=$([ -f "$ANCHOR/make_assets.py" ] && [ -x "$ANCHOR_VENV/bin/python" ] && echo 1 || echo 0)
if [ ! -d "$A/tiny-llama" ]; then
  if [ "$HAVE_TRL" = 1 ]; then "$ANCHOR_VENV/bin/python" "$ANCHOR/make_assets.py" >/dev/null
  else python bench/make_assets.py --out "$A" >/dev/null; fi
fi
[ "$HAVE_TRL" = 1 ] || echo "run_all: no $ANCHOR or $ANCHOR_VENV: ours only, on bench/make_assets.py's assets" >&2
tag() {  # the run's last JSON line, tagged; nothing for a run that printed none (TRL's, where it is not here)
  python -c "import json,sys; l=sys.stdin.read().strip().splitlines(); r=l and json.loads(l[-1]); r and r.update(run='$1'); r and print(json.dumps(r))"
}
trl() { [ "$HAVE_TRL" = 1 ] && (cd "$ANCHOR" && "$ANCHOR_VENV/bin/$1" "${@:2}" 2>/dev/null); }
ours() { "$@" 2>/dev/null; }
TR="-m torch.distributed.run --standalone --nproc_per_node 2"
for _ in $(seq "$ROUNDS"); do
  python bench/matmul_peak.py --threads 1 2 | tail -1 | tag matmul_peak_2_threads
  trl python trl_rm.py --threads 2 | tag trl_rm_1x2
  ours python bench/bench_rm.py --backbone $A/tiny-llama --pairs $A/pairs.jsonl --threads 2 --unfreeze_last all | tag ours_rm_full_1x2
  ours python bench/bench_rm.py --backbone $A/tiny-llama --pairs $A/pairs.jsonl --threads 2 | tag ours_rm_frozen_1x2
  trl python trl_rm.py --threads 1 | tag trl_rm_1x1
  ours python bench/bench_rm.py --backbone $A/tiny-llama --pairs $A/pairs.jsonl --threads 1 --unfreeze_last all | tag ours_rm_full_1x1
  trl torchrun --standalone --nproc_per_node 2 trl_rm.py --threads 1 | tag trl_rm_2x1
  ours python $TR bench/bench_rm.py --backbone $A/tiny-llama --pairs $A/pairs.jsonl --threads 1 --unfreeze_last all | tag ours_rm_full_2x1
  trl python "$ROOT/bench/trl_dpo.py" --threads 2 | tag trl_dpo_1x2
  ours python bench/bench_rm.py --trainer dpo --backbone $A/tiny-llama --pairs $A/pairs.jsonl --threads 2 | tag ours_dpo_1x2
  trl torchrun --standalone --nproc_per_node 2 "$ROOT/bench/trl_dpo.py" --threads 1 | tag trl_dpo_2x1
  ours python $TR bench/bench_rm.py --trainer dpo --backbone $A/tiny-llama --pairs $A/pairs.jsonl --threads 1 | tag ours_dpo_2x1
  trl python trl_grpo.py --threads 2 | tag trl_grpo_1x2
  ours python bench/bench_grpo.py --policy $A/tiny-llama --prompts $A/prompts.jsonl --threads 2 | tag ours_grpo_1x2
  ours python bench/bench_grpo.py --policy $A/tiny-llama --prompts $A/prompts.jsonl --threads 2 --compile 1 | tag ours_grpo_compiled_1x2
  trl torchrun --standalone --nproc_per_node 2 trl_grpo.py --threads 1 | tag trl_grpo_2x1
  ours python $TR bench/bench_grpo.py --policy $A/tiny-llama --prompts $A/prompts.jsonl --threads 1 | tag ours_grpo_2x1
  ours python $TR bench/bench_grpo.py --policy $A/tiny-llama --prompts $A/prompts.jsonl --threads 1 --compile 1 | tag ours_grpo_compiled_2x1
done
