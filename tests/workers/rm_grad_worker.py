"""Loss and gradients of one fixed global batch of 8 weighted pairs, split over however many ranks
this was launched with and into each of N_MICROS (comma-separated) micro-batches per rank in turn. Rank 0
saves them, {n_micro: results}, for the test to compare. COMPILE_BACKEND set: the blocks compiled with it.

    python tests/workers/rm_grad_worker.py ASSETS 1,4 OUT
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/rm_grad_worker.py ASSETS 1,2 OUT
"""
import contextlib
import os
import sys
from pathlib import Path

import torch

from nanochat_ext.algorithms.rm import rm_backward
from nanochat_ext.data.batching import BatchPlan, collate_pairs, tokenize_pairs
from nanochat_ext.data.rows import load_pairs
from nanochat_ext.ddp_common import all_reduce_sum, dist_session, wrap_ddp
from nanochat_ext.models.compiled import compile_blocks, compile_stats
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.models.reward_model import RewardModel
from nanochat_ext.tokenizer import TokenizerWrapper

GLOBAL_BATCH = 8
MODES = {"mean": 1.6, "sum": 1.6, "none": None}  # weight mode -> cap


def compute(assets: Path, n_micro: int, env) -> dict:
    """The gradients of one global batch on this rank. The DDP module dies with this frame, before
    the session tears the group down, as a trainer's does when its train function returns."""
    backbone = load_backbone(assets / "gpt")
    tok = TokenizerWrapper.load(assets / "tokenizer")
    backbone.set_trainable(1)
    if os.environ.get("COMPILE_BACKEND"):  # --compile's blocks, under this torch.compile backend
        compile_blocks(backbone, backend=os.environ["COMPILE_BACKEND"])
    model = RewardModel(backbone)
    model.init_head(0)
    ddp_model = wrap_ddp(model, env)
    rows = load_pairs(assets / "pairs.jsonl")[0][:GLOBAL_BATCH]
    for i, r in enumerate(rows):
        r.weight = 0.25 + 0.25 * i  # uneven weights, some above the cap
    pairs, _ = tokenize_pairs(rows, tok, 64)
    plan = BatchPlan.make(GLOBAL_BATCH, env.world_size, GLOBAL_BATCH // env.world_size // n_micro)
    mine = pairs[env.rank * plan.per_rank:(env.rank + 1) * plan.per_rank]
    batches = [collate_pairs(mine[i:i + plan.device_batch_size], tok.pad_id)
               for i in range(0, plan.per_rank, plan.device_batch_size)]
    results = {}
    for mode, cap in MODES.items():
        model.zero_grad(set_to_none=True)
        stats = rm_backward(ddp_model, batches, mode, cap, env.device, contextlib.nullcontext())
        loss = all_reduce_sum(stats[:1].clone()).item()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = {"loss": loss, "grads": grads, "graphs": compile_stats()[0]}
    return results


def main(assets: Path, n_micros: list[int], out: Path) -> None:
    """Every split in n_micros from one launch (a launch costs more than the computation)."""
    torch.set_num_threads(1)
    with dist_session("cpu") as env:
        results = {n_micro: compute(assets, n_micro, env) for n_micro in n_micros}
        if env.is_main:
            torch.save(results, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(n) for n in sys.argv[2].split(",")], Path(sys.argv[3]))
