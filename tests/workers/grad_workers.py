"""rm_grad_worker's and grpo_grad_worker's results from one launch, as each computes them (the same arguments and
COMPILE_BACKEND): rank 0 saves {worker: {n_micro: results}}. A launch costs more than both computations.

    python tests/workers/grad_workers.py ASSETS 1 OUT
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/grad_workers.py ASSETS 1 OUT
"""
import sys
from pathlib import Path

import grpo_grad_worker
import rm_grad_worker
import torch

from nanochat_ext.ddp_common import dist_session

WORKERS = {"rm_grad_worker": rm_grad_worker, "grpo_grad_worker": grpo_grad_worker}


def main(assets: Path, n_micros: list[int], out: Path) -> None:
    torch.set_num_threads(1)
    with dist_session("cpu") as env:
        results = {name: {n_micro: worker.compute(assets, n_micro, env) for n_micro in n_micros}
                   for name, worker in WORKERS.items()}
        if env.is_main:
            torch.save(results, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(n) for n in sys.argv[2].split(",")], Path(sys.argv[3]))
