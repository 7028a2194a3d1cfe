"""Evaluation of a policy on held-out prompts, over all ranks: the mean of each reward (and of their weighted total)
over one completion per prompt, greedy and at the training temperature; and pass@k, as nanochat's chat_rl
measures it on GSM8K (k samples at temperature 1, a prompt passes when any of its first k is correct), beside
the unbiased estimator of Chen et al. (2021) from all the samples.
"""
from __future__ import annotations

import dataclasses
import math
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


def pass_at_k(correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """correct (prompts, n) bool -> for k = 1..n, summed over the prompts: nanochat's pass@k (any of the first k
    samples correct) and the unbiased estimator 1 - C(n - c, k) / C(n, k) of Chen et al. from all n (c correct)."""
    n = correct.size(1)
    first = correct.cummax(1).values.double().sum(0)
    unbiased = torch.tensor([sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in correct.sum(1).tolist())
                             for k in range(1, n + 1)], dtype=torch.float64)
    return first, unbiased


@torch.no_grad()
def evaluate_pass_k(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], rewards: Rewards,
                    tok: TokenizerWrapper, sampling: SamplingConfig, k: int, seed: int, env: DistEnv,
                    autocast: ContextManager) -> dict:
    """Collective: `eval/pass@j` and `eval/pass@j_unbiased` for j = 1..k, from k samples per prompt at temperature
    1; a sample is correct when the task reward (the first reward function: gsm8k, exact_match) gives it 1."""
    column = rewards.task_column()
    mine = list(range(env.rank, len(rows), env.world_size))
    sums = torch.zeros(2 * k + 1, dtype=torch.float64)
    engine.model.eval()
    if mine:
        cfg = dataclasses.replace(sampling, temperature=1.0)
        with autocast:
            samples = engine.generate([prompt_ids[i] for i in mine], k, cfg, tok.eos_id, tok.pad_id,
                                      [torch.Generator().manual_seed(sample_seed(seed, -2, i)) for i in mine])
        per_reward, _ = rewards.score([rows[i] for i in mine], mine, [prompt_ids[i] for i in mine], samples, tok, k)
        first, unbiased = pass_at_k((per_reward[:, column] >= 1).view(len(mine), k))
        sums = torch.cat([first, unbiased, torch.tensor([len(mine)], dtype=torch.float64)])
    else:  # fewer eval prompts than ranks: still take part in the collectives of the others' call
        engine.refresh()
        raise_if_any(None)
    sums = all_reduce_sum(sums)
    n = max(sums[-1].item(), 1.0)
    return {**{f"eval/pass@{j}": sums[j - 1].item() / n for j in range(1, k + 1)},
            **{f"eval/pass@{j}_unbiased": sums[k + j - 1].item() / n for j in range(1, k + 1)}}
