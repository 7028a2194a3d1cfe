"""Preference pairs in a model's own words, for DPO: n samples of each prompt from the policy, judged by the task's
reward (the rewards' weighted total); the prompt's best sample is chosen and its worst rejected, where they differ.
A prompt whose samples all score alike (all right, or all wrong) gives no pair, and an empty reply (a stop at
once) is never picked: DPO's reader refuses an empty response. Each prompt is sampled from its own
generator (sampling.sample_seed), so which pairs come out does not depend on the ranks the prompts were shared over.
"""
from __future__ import annotations

import math
from contextlib import AbstractContextManager as ContextManager

import torch

from nanochat_ext.algorithms.evaluation import decoded
from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.ddp_common import DistEnv, gather_objects
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.tokenizer import TokenizerWrapper

KEPT = ("kind", "share", "answer", "topic")  # a prompt row's fields its pair keeps (the density experiment's kinds)
DRAW = -3  # the prompts' sampling draw: not a training step's (>= 0), nor an evaluation's (-1, -2)


def best_and_worst(totals: list[float | None]) -> tuple[int, int] | None:
    """(the index of the highest total, of the lowest) among those not None, the first of equals; None when fewer
    than two are left or all of them are equal."""
    usable = [j for j, t in enumerate(totals) if t is not None]
    if len(usable) < 2:
        return None
    best = max(usable, key=lambda j: (totals[j], -j))
    worst = min(usable, key=lambda j: (totals[j], j))
    return (best, worst) if totals[best] > totals[worst] else None


def pair_row(row: PromptRow, chosen: str, rejected: str, totals: tuple[float, float]) -> dict:
    """A pair in the conversational format the DPO reader takes (data.rows.parse_pair), with the prompt row's kind
    fields and both replies' rewards."""
    return {"prompt": row.messages, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
            "prefix_id": row.prefix_id, **{k: row.row[k] for k in KEPT if k in row.row},
            "chosen_reward": totals[0], "rejected_reward": totals[1]}


@torch.no_grad()
def own_words_pairs(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], rewards: Rewards,
                    tok: TokenizerWrapper, cfg: SamplingConfig, n: int, seed: int, env: DistEnv,
                    autocast: ContextManager, per_call: int) -> tuple[list[dict], dict]:
    """Collective: (the pairs in prompt order, on every rank; counts: prompts, pairs, the samples' mean reward).
    Each rank samples every W-th prompt, per_call prompts a generate call."""
    mine: list[tuple[int, dict]] = []
    reward_sum = 0.0
    for call, samples, per_reward in decoded(engine, rows, prompt_ids, n, cfg, rewards, tok, seed, DRAW, env,
                                             autocast, per_call):
        totals = rewards.total(per_reward).view(len(call), n).tolist()
        replies = samples.replies(tok)
        reward_sum += sum(t for row in totals for t in row if not math.isnan(t))
        for k, i in enumerate(call):  # an empty reply, or one the machine failed to score (NaN), is never picked
            picked = best_and_worst([t if replies[k * n + j].strip() and not math.isnan(t) else None
                                     for j, t in enumerate(totals[k])])
            if picked:
                best, worst = picked
                mine.append((i, pair_row(rows[i], replies[k * n + best], replies[k * n + worst],
                                         (totals[k][best], totals[k][worst]))))
    gathered = gather_objects((mine, reward_sum))
    pairs = [p for _, p in sorted((x for part, _ in gathered for x in part), key=lambda x: x[0])]
    counts = {"prompts": len(rows), "pairs": len(pairs),
              "mean_reward": sum(s for _, s in gathered) / max(len(rows) * n, 1)}
    return pairs, counts
