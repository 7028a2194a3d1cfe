"""Started twice by the test with a launcher's environment (torchrun, OpenMPI, MVAPICH2 or SLURM
variables); exercises every collective of ddp_common in a real group and prints one JSON line.
argv: [backend] [diverge]. Backend 'cuda:gloo' makes the default group serve CUDA tensors only, as
NCCL does, so each helper must route CPU tensors to a group that serves them."""
import json
import sys

import torch
import torch.distributed as dist

from nanochat_ext import ddp_common as dc
from nanochat_ext.algorithms.advantages import advantages
from nanochat_ext.algorithms.rollout_batch import RolloutBatch

# Two groups of 4 rewards per rank, rank 1's spread far wider than rank 0's: --scale_rewards batch divides every
# rank's advantages by the std of the whole global batch, which neither rank's own rewards give.
# REINFORCE++'s per-token inputs for REWARDS' 16 completions: pi_old's and the reference's log-probs, ragged masks
_g = torch.Generator().manual_seed(0)
TOKENS = {"engine_logp": -torch.rand(16, 5, generator=_g) * 3, "ref_logp": -torch.rand(16, 5, generator=_g) * 3,
          "mask": (torch.arange(5)[None] < torch.randint(1, 6, (16, 1), generator=_g)).float()}
REWARDS = torch.tensor([0.1, 0.2, 0.0, 0.3, 1.0, 1.1, 0.9, 1.2, -4.0, 2.0, 0.5, 3.0, 5.0, -1.0, 0.0, 2.5])


def ddp_step(env: dc.DistEnv) -> list:
    """DDP over a CPU module: gradients averaged over ranks through the group that serves CPU. The module
    is gone when this returns, as a trainer's is when its train function returns."""
    layer = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(layer.weight)
    ddp = dc.wrap_ddp(layer, env)
    ddp(torch.full((1, 2), float(env.rank + 1))).sum().backward()
    return layer.weight.grad.tolist()


def main(backend: str | None, diverge: bool) -> None:
    with dc.dist_session("cpu", backend) as env:
        total = dc.all_reduce_sum(float(env.rank + 1))
        summed = dc.all_reduce_sum(torch.tensor([1.0, env.rank], dtype=torch.float64))
        top = dc.all_reduce_max(float(env.rank))
        stamp = dc.broadcast_object(1000 + env.rank)
        gathered = dc.gather_objects({"rank": env.rank})
        dc.barrier()
        params = [torch.ones(3) * (1.0 + (env.rank if diverge else 0))]
        try:
            dc.check_params_in_sync(params)
            in_sync = True
        except RuntimeError:
            in_sync = False
        ddp_grad = ddp_step(env)
        half = REWARDS.view(env.world_size, -1)[env.rank]
        tokens = RolloutBatch(**{k: v.view(env.world_size, -1, v.size(1))[env.rank] for k, v in TOKENS.items()})
        # RLOO's with its KL in the reward (GRPO's reads no tokens)
        batch_advantages = {f"{estimator}/{mode}": advantages(estimator, half, 4, "batch", mode, batch=tokens,
                                                              kl_coef=0.05, kl_estimator="k2").tolist()
                            for estimator in ("grpo", "rloo") for mode in ("sample", "population")}
        batch_advantages["reinforce_pp_baseline/-"] = advantages("reinforce_pp_baseline", half, 4, "-", batch=tokens,
                                                                  kl_coef=0.05, kl_estimator="k2").tolist()
        raw_error = None
        try:  # the rule itself: a CPU tensor handed straight to the default group
            dist.all_reduce(torch.ones(1))
        except RuntimeError as e:
            raw_error = str(e).splitlines()[0]
        print(json.dumps({"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
                          "backend": env.backend, "sum": total, "tensor_sum": summed.tolist(), "max": top,
                          "stamp": stamp, "gathered": gathered, "in_sync": in_sync,
                          "ddp_grad": ddp_grad, "batch_advantages": batch_advantages, "raw_error": raw_error}),
              flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(next((a for a in args if a != "diverge"), None), "diverge" in args)
