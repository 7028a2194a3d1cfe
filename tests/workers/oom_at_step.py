"""A trainer that runs out of memory: `oom_at_step.py MODULE N ARGS` runs scripts.MODULE with ARGS, and on every rank
the N-th computation of the reward model's loss (once per micro-batch, in the forward) raises the error torch raises
when CUDA memory runs out, with its wording."""
import importlib
import sys

import torch

from nanochat_ext.algorithms import rm as reward

module, n = sys.argv[1], int(sys.argv[2])
calls = [0]
real_loss = reward.bradley_terry_loss


def loss_until_out_of_memory(*args, **kwargs):
    calls[0] += 1
    if calls[0] == n:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of "
                                     "79.19 GiB of which 1.06 GiB is free.")
    return real_loss(*args, **kwargs)


reward.bradley_terry_loss = loss_until_out_of_memory
sys.exit(importlib.import_module(f"scripts.{module}").main(sys.argv[3:]))
