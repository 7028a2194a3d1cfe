"""Loss and gradients of one fixed GRPO rollout batch (4 prompts x G=4, uneven density weights, a
reference model, old log-probs that make the clip bite, temperature 0.8, two completions masked as
--mask_truncated does), split over however many ranks this was launched with and into each of N_MICROS
(comma-separated) micro-batches per rank in turn, for every --loss_agg x --importance_level, with one row
per completion and with each group's prompt shared by its completions (PrefixTree rows). Rank 0 saves them,
{n_micro: results}. COMPILE_BACKEND set: the policy's and reference's blocks compiled with it.

    python tests/workers/grpo_grad_worker.py ASSETS 1,4 OUT
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/grpo_grad_worker.py ...
"""
import contextlib
import os
import sys
from pathlib import Path

import torch

from nanochat_ext.algorithms.advantages import group_advantages
from nanochat_ext.algorithms.grpo import policy_backward
from nanochat_ext.algorithms.grpo_config import IMPORTANCE_LEVELS, LOSS_AGGS, LossConfig
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.ddp_common import all_reduce_sum, dist_session, wrap_ddp
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.models.compiled import compile_blocks, compile_stats
from nanochat_ext.models.loader import load_backbone
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences, token_logprobs

N_PROMPTS, G = 4, 4
TEMPERATURE = 0.8
PROMPTS = [[5, 17, 42], [3, 250, 7, 7], [11, 12], [400, 401, 402, 403, 404]]


def rollout(assets: Path, rank: int, world: int, share_prompt: bool):
    """This rank's share of a batch that is the same whatever the world size (seeded by prompt)."""
    policy = load_backbone(assets / "gpt")
    per_rank = N_PROMPTS // world
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0)
    samples = Engine(policy).generate([PROMPTS[i] for i in mine], G, cfg, 101, 0,
                              [torch.Generator().manual_seed(100 + i) for i in mine])
    # Ragged lengths (2..6 tokens by global row), so the three loss aggregations give different numbers.
    first_row = rank * per_rank * G
    completions = [c[:2 + (first_row + r) % 5] for r, c in enumerate(samples.completions)]
    batch = make_sequences([PROMPTS[i] for i in mine], completions, G, 0, share_prompt)
    rewards = torch.tensor([float(sum(c) % 7) for c in completions])
    if rank == 0:
        rewards[:G] = 1.0  # global prompt 0: a group with zero reward spread
    batch = RolloutBatch.of(batch, advantages=group_advantages(rewards, G, "group"),
                            weights=torch.tensor([0.5 + i for i in mine], dtype=torch.float32).repeat_interleave(G))
    for r in range(len(completions)):  # global rows 5 and 10 masked, as --mask_truncated masks cut completions
        if (first_row + r) in (5, 10):
            batch.mask[r] = 0.0
    return policy, batch


def compute(assets: Path, n_micro: int, env) -> dict:
    """The gradients of one global batch on this rank. The DDP module dies with this frame, before
    the session tears the group down, as a trainer's does when its train function returns."""
    results = {}
    for share_prompt in (False, True):
        for cfg, r in compute_layout(assets, n_micro, env, share_prompt).items():
            results[f"{cfg}/{'shared' if share_prompt else 'rows'}"] = r
    return results


def compute_layout(assets: Path, n_micro: int, env, share_prompt: bool) -> dict:
    policy, batch = rollout(assets, env.rank, env.world_size, share_prompt)
    reference = load_backbone(assets / "gpt").requires_grad_(False)
    if os.environ.get("COMPILE_BACKEND"):  # --compile's blocks, under this torch.compile backend
        for bb in (policy, reference):
            compile_blocks(bb, backend=os.environ["COMPILE_BACKEND"])
    with torch.no_grad():
        for i, p in enumerate(reference.parameters()):
            p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=p.dtype) + i).view_as(p))
    batch.ref_logp = token_logprobs(CompletionLogprobs(reference, temperature=TEMPERATURE),
                                       batch, 64, env.device, contextlib.nullcontext())
    # Old log-probs 0.3 nats off in a pattern fixed by (global row, token): ratios leave [0.8, 1.2] and
    # the clip is exercised, identically whatever the split.
    n, L = batch.ref_logp.shape
    rows = torch.arange(n)[:, None] + env.rank * n
    batch.old_logp = batch.ref_logp + 0.3 * torch.cos(rows * 7.0 + torch.arange(L)[None, :])
    policy.set_trainable("all")
    model = CompletionLogprobs(policy, temperature=TEMPERATURE)
    ddp_model = wrap_ddp(model, env)
    micro = N_PROMPTS // env.world_size * G // n_micro
    results = {}
    for agg in LOSS_AGGS:
        for level in IMPORTANCE_LEVELS:
            cfg = LossConfig(loss_agg=agg, clip_eps=0.2, clip_eps_high=0.28, beta=0.1, max_new_tokens=8,
                             importance_level=level)
            model.zero_grad(set_to_none=True)
            stats = policy_backward(ddp_model, batch, micro, cfg, env.device, contextlib.nullcontext())
            totals = all_reduce_sum(stats.clone())
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results[f"{agg}/{level}"] = {"loss": totals[0].item(), "clipped": totals[2].item(),
                                         "tokens": totals[3].item(), "grads": grads,
                                         "graphs": compile_stats()[0]}
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
