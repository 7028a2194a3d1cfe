"""GRPO's evaluation on held-out prompts: the mean of each reward (and of their weighted total) over one
completion per prompt, greedy and at the training temperature, over all ranks.
"""
from __future__ import annotations

import dataclasses
from typing import ContextManager

import torch

from nanochat_ext.data import PromptRow
from nanochat_ext.ddp_common import DistEnv, all_reduce_sum, raise_if_any
from nanochat_ext.engine import Engine
from nanochat_ext.rewards import Rewards
from nanochat_ext.sampling import SamplingConfig, sample_seed
from nanochat_ext.tokenizer import TokenizerWrapper

SHOWN = 3  # greedy samples each evaluation shows (rank 0's first prompts)


@torch.no_grad()
def evaluate_rewards(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], rewards: Rewards,
                     tok: TokenizerWrapper, sampling: SamplingConfig, seed: int, env: DistEnv,
                     autocast: ContextManager) -> tuple[dict, list[tuple[str, str]]]:
    """Collective: (metrics, shown): `eval/reward_{greedy,sampled}` and each reward's `eval/<name>_{mode}`, and
    some greedy (prompt, completion) pairs on rank 0. Each rank takes every W-th prompt; one reduction at the end."""
    mine = list(range(env.rank, len(rows), env.world_size))
    k = len(rewards.names)
    sums = torch.zeros(2 * (k + 1) + 1, dtype=torch.float64)
    shown = []
    engine.model.eval()
    for j, temperature in enumerate((0.0, sampling.temperature)):
        if not mine:  # fewer eval prompts than ranks: still take part in the collectives of the others' call
            engine.refresh()  # (a sharded policy's weights are gathered from every rank)
            raise_if_any(None)
            continue
        cfg = dataclasses.replace(sampling, temperature=temperature)
        with autocast:
            samples = engine.generate([prompt_ids[i] for i in mine], 1, cfg, tok.eos_id, tok.pad_id,
                                      [torch.Generator().manual_seed(sample_seed(seed, -1, i)) for i in mine])
        per_reward, _ = rewards.score([rows[i] for i in mine], mine, [prompt_ids[i] for i in mine], samples, tok, 1)
        sums[j * (k + 1):(j + 1) * (k + 1)] += torch.cat([rewards.total(per_reward).sum().view(1), per_reward.sum(0)])
        if temperature == 0 and env.is_main:
            shown = [(rows[mine[i]].messages[-1]["content"], tok.decode(samples.completions[i]))
                     for i in range(min(SHOWN, len(mine)))]
    sums[-1] = len(mine)
    sums = all_reduce_sum(sums)
    n = max(sums[-1].item(), 1.0)
    out = {}
    for j, mode in enumerate(("greedy", "sampled")):
        out[f"eval/reward_{mode}"] = sums[j * (k + 1)].item() / n
        for r, name in enumerate(rewards.names):
            out[f"eval/{name}_{mode}"] = sums[j * (k + 1) + 1 + r].item() / n
    return out, shown
