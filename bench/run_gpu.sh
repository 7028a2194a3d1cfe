#!/usr/bin/env bash
# The one GPU command: from a clean clone on a machine with a CUDA torch already installed and no network
# (no venv, nothing downloaded), in one sitting: the CUDA-marked tests, then ours (bench_gpu.py: the RM, GRPO, DPO,
# decoding, the optimizer) and Hugging Face TRL (trl_gpu.py: GRPO, DPO) shape by shape. Every figure is a JSON line in one file; a table ends the output.
#   bash bench/run_gpu.sh                  # SHAPES="d12 d20 d24:32768" (d24:32768: nanochat's speedrun model)
#                                          # and SmolLM2's shape where its config is carried (REAL_SHAPE, below)
# What the machine lacks (our pins of transformers, tokenizers and rustbpe; TRL and its dependencies) comes as
# wheels in $WHEELS (default .whl, ignored by git): `bash bench/fetch_gpu_wheels.sh` makes them on a machine
# with pip access; carry .whl with the checkout. Results: $RESULTS (default bench/results/gpu_<UTC time>.jsonl,
# or in $OUT where the device tool sets it). Knobs: SHAPES, FSDP_SHAPES (d20), LORA_SHAPES (d20 d24:32768), DEVICE (cuda), BENCH_ARGS and TRL_ARGS (extra flags
# for bench_gpu.py and trl_gpu.py), TRL (1; 0: no TRL rows), CUDA_TESTS (1; 0 skips the tests; CUDA_TEST_WORKERS: in N processes), NANOCHAT_SRC (default .nanochat, ignored by
# git: a nanochat checkout's root, whose Engine then decodes beside ours; make it where a nanochat clone is, e.g.
# `mkdir .nanochat && git -C ~/nanochat archive HEAD nanochat | tar -x -C .nanochat`, and carry it like .whl).
# The test suite runs it on CPU: DEVICE=cpu SHAPES=tiny BENCH_ARGS="...". It starts with an import check of every
# carried wheel, then the CUDA tests (each cut at CUDA_TEST_TIMEOUT seconds, default 300: one hung test fails alone;
# their log, a line per test as it ends, beside $RESULTS) and the LM head's log-prob chain eager and compiled (LM_HEAD=0
# skips it; LM_HEAD_ARGS for bench_lm_head.py). Where one call is limited to 10 minutes (the lent H100s), split it:
# `SHAPES= FSDP_SHAPES= LORA_SHAPES= bash bench/run_gpu.sh` (the tests and the LM head), then
# `CUDA_TESTS=0 LM_HEAD=0 SHAPES=d12 FSDP_SHAPES= LORA_SHAPES= bash bench/run_gpu.sh`,
# `CUDA_TESTS=0 LM_HEAD=0 SHAPES="d20 d24:32768" FSDP_SHAPES= LORA_SHAPES= bash bench/run_gpu.sh`, then
# `CUDA_TESTS=0 LM_HEAD=0 SHAPES= bash bench/run_gpu.sh` (FSDP at d20, LoRA at d20, d24, SmolLM2's shape). Seen on an
# H100 (2026-11-27): the LM head ~30 s; d12's RM and GRPO rows ~370 s (its decode rows and TRL's did not fit in 378 s);
# the CUDA tests over 270 s. A lease of 15 minutes in all (machine start included) holds about two of these parts.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
export NANOCHAT_SYSTEM_PYTHON=1  # speedrun.sh (run by the CUDA tests) uses this python, not a venv
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}
RESULTS=${RESULTS:-${OUT:-bench/results}/gpu_$(date -u +%Y-%m-%d_%H%M%S).jsonl}
mkdir -p "$(dirname "$RESULTS")"
: > "$RESULTS"
status=0  # non-zero when any step failed; every step still runs
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  if python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    status=1
    echo "run_gpu: the wheels in $WHEELS did not install: the image's own packages run" >&2
  fi
  # Each carried wheel imports beside the image's packages (transformers 5.23 needs regex >= 2025.10.22), or its
  # error is one line here and in the results, before anything depends on it.
  python3 - "$WHEELS"/*.whl >> "$RESULTS" <<'PY' || status=1
import importlib, importlib.metadata, json, sys
from pathlib import Path
ok, failed = {}, {}
for wheel in sys.argv[1:]:
    name, carried = Path(wheel).name.split("-")[:2]
    name = name.lower()
    try:
        importlib.import_module(name)
        found = importlib.metadata.version(name)
        if found != carried:
            raise ImportError(f"the image's {found} is found first, not the carried {carried}")
        ok[name] = found
    except Exception as e:  # what a user would hit at import, whatever it is
        failed[name] = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"run_gpu: the carried {name} does not import: {failed[name]}", file=sys.stderr)
print(json.dumps({"bench": "imports", "ok": ok, "failed": failed}))
sys.exit(1 if failed else 0)
PY
fi
if [ "${CUDA_TESTS:-1}" = 1 ]; then
  # Streamed, a line per test, into a log beside the results: a call cut short still tells which tests passed.
  tests_log="${RESULTS%.jsonl}_cuda_tests.log"
  # CUDA_TEST_WORKERS=N runs them in N processes (pytest-xdist, in the image) on the one GPU: the slowest alone sets the time.
  workers=()
  [ "${CUDA_TEST_WORKERS:-1}" -gt 1 ] && workers=(-n "$CUDA_TEST_WORKERS")
  CUDA_TEST_TIMEOUT=${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -v --durations=0 -p no:cacheprovider "${workers[@]}" -m cuda tests 2>&1 |
    tee "$tests_log" >&2 || status=1
  python3 -c 'import json, sys; print(json.dumps({"bench": "cuda_tests", "summary": sys.argv[1]}))' \
      "$(tail -n 1 "$tests_log")" >> "$RESULTS"
fi
if [ "${LM_HEAD:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  python3 bench/bench_lm_head.py --device "$DEVICE" ${LM_HEAD_ARGS:---rows 4096 --vocab 65536 --hidden 1280} |
    tee -a "$RESULTS" || status=1
fi
NANOCHAT_SRC=${NANOCHAT_SRC:-.nanochat}
NANOCHAT_ARGS=()
[ -d "$NANOCHAT_SRC/nanochat" ] && NANOCHAT_ARGS=(--nanochat_src "$NANOCHAT_SRC")
for shape in ${SHAPES-d12 d20 d24:32768}; do
  # shellcheck disable=SC2086
  python3 bench/bench_gpu.py --device "$DEVICE" --shapes "$shape" "${NANOCHAT_ARGS[@]}" ${BENCH_ARGS:-} | tee -a "$RESULTS" ||
    status=1
  if [ "${TRL:-1}" = 0 ]; then
    :
  elif python3 -c "import trl" 2>/dev/null; then
    # shellcheck disable=SC2086
    for trainer in grpo dpo; do
      # shellcheck disable=SC2086
      python3 bench/trl_gpu.py --device "$DEVICE" --shape "$shape" --trainer $trainer ${TRL_ARGS:-} |
        grep '^{"bench"' | tee -a "$RESULTS" || status=1
    done
  else
    echo "run_gpu: trl does not import here: no TRL figures (bring its wheels in $WHEELS)" >&2
  fi
done
# Past one GPU's memory (parallel.py): the same RM full fine-tune and GRPO step under FSDP2 on a one-rank group,
# without and with activation checkpointing, beside the plain runs above. FSDP_SHAPES="" skips it.
for shape in ${FSDP_SHAPES-d20}; do
  for ac in "" --activation_checkpointing; do
    # shellcheck disable=SC2086
    python3 bench/bench_gpu.py --device "$DEVICE" --shapes "$shape" --only both --parallel fsdp $ac ${BENCH_ARGS:-} |
      tee -a "$RESULTS" || status=1
  done
done
# LoRA (lora.py) against the full fine-tunes above: the GRPO step with adapters of rank 16 on every linear layer of
# the blocks, the reference being the base itself. LORA_SHAPES="" skips it.
for shape in ${LORA_SHAPES-d20 d24:32768}; do
  # shellcheck disable=SC2086
  python3 bench/bench_gpu.py --device "$DEVICE" --shapes "$shape" --only grpo --lora_r 16 ${BENCH_ARGS:-} |
    tee -a "$RESULTS" || status=1
done
# The real model (MODEL=smollm2): SmolLM2-135M-Instruct's shape, carried without its weights in $REAL_SHAPE (default
# .smollm2, ignored by git: `python bench/model_shape.py strip $NANOCHAT_BASE_DIR/models/smollm2-135m-instruct .smollm2`
# writes its config and tokenizer, 4 MB; the weights, 538 MB, exceed what a call carries), given random weights
# here: GRPO completions/s on the task's prompts (1 prompt x 8 completions of exactly 32 tokens, beta 0.04), ours and
# TRL's, bf16 on CUDA both, as bench/bench_real_model.sh measures them on CPU. REAL_ARGS: more bench_grpo.py flags.
REAL_SHAPE=${REAL_SHAPE-.smollm2}
if [ -f "$REAL_SHAPE/config.json" ]; then
  real=$(mktemp -d)
  if python3 bench/model_shape.py fill "$REAL_SHAPE" "$real/model" >/dev/null &&
      python3 -m scripts.kat_task_data --out "$real/task" >/dev/null; then
    # shellcheck disable=SC2086
    python3 bench/bench_grpo.py --policy "$real/model" --prompts "$real/task/train.jsonl" --device "$DEVICE" \
        ${REAL_ARGS:-} | grep '^{"bench"' | tee -a "$RESULTS" || status=1
    if python3 -c "import trl" 2>/dev/null; then
      python3 bench/trl_real_model.py --mode throughput --model "$real/model" --task "$real/task" --device "$DEVICE" |
        grep '^{"bench"' | tee -a "$RESULTS" || status=1
    fi
  else
    status=1
  fi
  rm -rf "$real"
elif [ -n "$REAL_SHAPE" ]; then
  echo "run_gpu: no $REAL_SHAPE/config.json: the real model's figures are not measured (bench/model_shape.py strip)" >&2
fi
python3 bench/gpu_table.py "$RESULTS" || status=1
echo "run_gpu: figures in $RESULTS$([ $status = 0 ] || echo '; a step failed, see above')" >&2
exit $status
