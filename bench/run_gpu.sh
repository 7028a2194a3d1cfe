#!/usr/bin/env bash
# On a GPU machine, in one sitting: the CUDA-marked tests, then ours (bench_gpu.py) and Hugging Face TRL
# (trl_gpu.py) at d12 and d20, interleaved; JSON lines on stdout.
# TRL is not installed on the lent GPU machines: bring it as wheels in $WHEELS (default .whl, ignored by
# git), fetched on a machine with pip access, e.g.
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets==5.2.0 tokenizers==0.23.3 ...
# (the rest of ../shared/anchor-bench/requirements-bench.txt that the machine lacks).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
python3 -m pytest -q -m cuda tests >&2
for shape in ${SHAPES:-d12 d20}; do
  python3 bench/bench_gpu.py --shapes "$shape"
  python3 -c "import trl" 2>/dev/null && python3 bench/trl_gpu.py --shape "$shape" | tail -1
done
