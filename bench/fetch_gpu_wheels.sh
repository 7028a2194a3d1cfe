#!/usr/bin/env bash
# Wheels for bench/run_gpu.sh on the lent GPU machines (Python 3.12, x86_64, a CUDA torch preinstalled, no
# network), fetched here with pip: what their image lacks (rustbpe, gguf, TRL, datasets and two of its dependencies,
# the regex transformers 5.23 needs) or holds at another version than requirements.txt pins (transformers, tokenizers),
# and peft for --lora_r. Into $WHEELS (default .whl, ignored by git); carry it with the checkout (the device tool's
# carry: [".whl"]). Every pin of requirements.txt is fetched here or named in one of the two lists below
# (tests/test_bench.py checks it): without gguf's wheel the CUDA tests stopped at collection on 2026-11-27.
# In the image as last read (2026-11-17), at the pinned version or one that serves:
IMAGE_HAS="torch numpy accelerate tiktoken tensorboard pyarrow tqdm matplotlib pillow pytest pytest-xdist execnet"
# Not needed there: wandb is imported by --report_to wandb alone, which no CUDA test or bench uses; ruff lints here,
# before the suite (run_tests.sh), not on the GPU machine (bench/run_gpu.sh runs pytest itself).
NOT_CARRIED="wandb ruff"
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$WHEELS" \
    transformers==5.23.0 tokenizers==0.23.3 rustbpe==0.1.0 gguf==0.19.0 peft==0.21.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyseccomp==0.1.2 \
    regex==2026.11.15
du -sh "$WHEELS"
echo "fetch_gpu_wheels: in the image already: $IMAGE_HAS; not carried: $NOT_CARRIED"
