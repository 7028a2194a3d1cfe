"""Evaluation of a policy on held-out prompts, over all ranks: the mean of each reward (and of their weighted total)
over one completion per prompt, greedy and at the training temperature; and pass@k, as nanochat's chat_rl
measures it on GSM8K (k samples at temperature 1, a prompt passes when any of its first k is correct), beside
the unbiased estimator of Chen et al. (2021) from all the samples.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch

from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.config import option
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.ddp_common import DistEnv, all_reduce_sum, raise_if_any
from nanochat_ext.engine.engine import Engine, Samples
from nanochat_ext.engine.sampling import SamplingConfig, sample_seed
from nanochat_ext.tokenizer import TokenizerWrapper

SHOWN = 3  # greedy samples each evaluation shows (rank 0's first prompts)


@dataclass(frozen=True)
class EvalConfig:
    """GRPO's held-out evaluation: which prompts, how many, and pass@k."""
    eval_prompts: str | None = option(None, "held-out prompts for --eval_every (default: --val_ratio of --prompts, "
                                            "split by prefix_id)")
    eval_examples: int = option(0, "evaluate on the first N eval prompts (0: all)", type=int,
                                check=(lambda v: v >= 0, ">= 0 (0: all)"))
    eval_pass_k: int = option(0, "also pass@1..K at each evaluation: K samples per eval prompt at temperature 1, "
                                 "correct where the first --reward_fn (e.g. gsm8k) gives 1, as nanochat's chat_rl; "
                                 "beside it the unbiased estimator (Chen et al. 2021) (0: off)", type=int,
                              check=(lambda v: v >= 0, ">= 0 (0: off)"))


def calls_of(mine: list[int], n_prompts: int, world: int, per_call: int) -> list[list[int]]:
    """This rank's prompts in generate calls of at most per_call, as many calls as the rank with the most: an
    empty one takes part in the others' collectives (a sharded policy's weights are gathered from every rank)."""
    per_call = max(per_call, 1)
    most = -(-n_prompts // world)  # the most prompts a rank holds: ceil(n_prompts / world)
    calls = -(-most // per_call)
    return [mine[i * per_call:(i + 1) * per_call] for i in range(calls)]


def eval_decode_rows(n_prompts: int, world: int, max_rows: int, pass_k: int = 0) -> list[int]:
    """The row counts of the generate calls one evaluation makes (evaluate_rewards, and evaluate_pass_k with
    pass_k) on the rank whose calls have the most distinct ones, which are the decode states a compiled engine keeps
    for them (one per row count): what memory.grpo_memory counts."""
    worst: list[int] = []
    for rank in range(min(world, n_prompts)):
        mine = list(range(rank, n_prompts, world))
        rows = {len(c) for c in calls_of(mine, n_prompts, world, max_rows) if c}
        if pass_k:
            rows |= {len(c) * pass_k for c in calls_of(mine, n_prompts, world, max_rows // pass_k) if c}
        worst = max(worst, sorted(rows), key=sum)
    return worst


def generate_and_score(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], call: list[int], n: int,
                       cfg: SamplingConfig, rewards: Rewards, tok: TokenizerWrapper, seed: int, draw: int,
                       autocast: ContextManager):
    """Collective: n samples of each prompt of one call and their rewards (samples, per_reward); (None, None) for an
    empty call, which still takes part in the collectives of the others' call."""
    if not call:
        engine.refresh()
        raise_if_any(None)
        return None, None
    with autocast:
        samples = engine.generate([prompt_ids[i] for i in call], n, cfg, tok.stop_ids, tok.pad_id,
                                  [torch.Generator().manual_seed(sample_seed(seed, draw, i)) for i in call],
                                  [rows[i].row for i in call])
    return samples, rewards.score([rows[i] for i in call], [prompt_ids[i] for i in call], samples, tok, n)[0]


def decoded(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], n: int, cfg: SamplingConfig,
            rewards: Rewards, tok: TokenizerWrapper, seed: int, draw: int, env: DistEnv, autocast: ContextManager,
            per_call: int) -> Iterator[tuple[list[int], Samples, torch.Tensor]]:
    """Collective (every rank runs it to the end): this rank's prompts (every W-th) decoded n samples each, per_call
    prompts a call, as many calls as the rank with the most; yields (call, samples, per_reward) of each call that
    has prompts."""
    engine.model.eval()
    mine = list(range(env.rank, len(rows), env.world_size))
    for call in calls_of(mine, len(rows), env.world_size, per_call):
        samples, per_reward = generate_and_score(engine, rows, prompt_ids, call, n, cfg, rewards, tok, seed, draw,
                                                 autocast)
        if samples is not None:
            yield call, samples, per_reward


def over_ranks(sums: torch.Tensor, n_prompts: int, env: DistEnv) -> tuple[torch.Tensor, float]:
    """Collective: this rank's sums summed over all ranks, and the number of prompts they cover (at least 1)."""
    mine = len(range(env.rank, n_prompts, env.world_size))
    total = all_reduce_sum(torch.cat([sums, torch.tensor([float(mine)], dtype=sums.dtype)]))
    return total[:-1], max(total[-1].item(), 1.0)


@torch.no_grad()
def evaluate_rewards(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], rewards: Rewards,
                     tok: TokenizerWrapper, sampling: SamplingConfig, seed: int, env: DistEnv,
                     autocast: ContextManager, max_rows: int) -> tuple[dict, list[tuple[str, str]]]:
    """Collective: (metrics, shown): `eval/reward_{greedy,sampled}` and each reward's `eval/<name>_{mode}`, and
    some greedy (prompt, completion) pairs on rank 0. Each rank takes every W-th prompt, decoded max_rows at a time
    (a rollout's rows: what the memory model counts); one reduction at the end."""
    k = len(rewards.names)
    sums = torch.zeros(2 * (k + 1), dtype=torch.float64)
    shown = []
    for j, temperature in enumerate((0.0, sampling.temperature)):
        cfg = dataclasses.replace(sampling, temperature=temperature)
        for call, samples, per_reward in decoded(engine, rows, prompt_ids, 1, cfg, rewards, tok, seed, -1, env,
                                                 autocast, max_rows):
            per_reward = per_reward.nan_to_num(0.0)  # a sample the machine failed to score (errors.Unscored): 0
            sums[j * (k + 1):(j + 1) * (k + 1)] += torch.cat([rewards.total(per_reward).sum().view(1),
                                                              per_reward.sum(0)])
            if temperature == 0 and env.is_main and not shown:
                shown = [(rows[call[i]].messages[-1]["content"], tok.decode(samples.completions[i]))
                         for i in range(min(SHOWN, len(call)))]
    sums, n = over_ranks(sums, len(rows), env)
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
                    autocast: ContextManager, max_rows: int) -> dict:
    """Collective: `eval/pass@j` and `eval/pass@j_unbiased` for j = 1..k, from k samples per prompt at temperature
    1 (decoded at most max_rows at a time); a sample is correct when the task reward (the first reward function:
    gsm8k, exact_match) gives it 1."""
    column = rewards.task_column()
    sums = torch.zeros(2 * k, dtype=torch.float64)
    cfg = dataclasses.replace(sampling, temperature=1.0)
    for call, _, per_reward in decoded(engine, rows, prompt_ids, k, cfg, rewards, tok, seed, -3, env, autocast,
                                       max_rows // k):
        sums += torch.cat(pass_at_k((per_reward[:, column] >= 1).view(len(call), k)))
    sums, n = over_ranks(sums, len(rows), env)
    return {**{f"eval/pass@{j}": sums[j - 1].item() / n for j in range(1, k + 1)},
            **{f"eval/pass@{j}_unbiased": sums[k + j - 1].item() / n for j in range(1, k + 1)}}


@torch.no_grad()
def evaluate_tool_use(engines: tuple[Engine, Engine], rows: list[PromptRow], prompt_ids: list[list[int]],
                      rewards: Rewards, tok: TokenizerWrapper, sampling: SamplingConfig, seed: int, env: DistEnv,
                      autocast: ContextManager, max_rows: int) -> dict:
    """Collective: the task reward's accuracy (the first reward function gives 1) of one greedy completion per
    prompt, with the calculator (engines[0]) and without it (engines[1]), and with it the calls per completion and
    the share of calls it refused."""
    column = rewards.task_column()
    sums = torch.zeros(4, dtype=torch.float64)  # correct with tools, without, calls, refused
    cfg = dataclasses.replace(sampling, temperature=0.0)
    for j, engine in enumerate(engines):
        for _, samples, per_reward in decoded(engine, rows, prompt_ids, 1, cfg, rewards, tok, seed, -1, env, autocast,
                                              max_rows):
            sums[j] += float((per_reward[:, column] >= 1).sum())
            if j == 0:
                sums[2:4] += torch.tensor([samples.tool_calls, samples.tool_errors], dtype=torch.float64)
    sums, n = over_ranks(sums, len(rows), env)
    return {"accuracy_with_tools": sums[0].item() / n, "accuracy_without_tools": sums[1].item() / n,
            "tool_calls": sums[2].item() / n, "tool_errors": sums[3].item() / max(sums[2].item(), 1.0)}
