"""GRPO's rollouts on each rank: a draw of prompts sampled and scored, DAPO's dynamic sampling over draws,
the sums a log window keeps of them and the metrics those sums give, and the rollout log.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import ContextManager

import torch

from nanochat_ext.algorithms.grpo import LOSS_STATS
from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.data.batching import GlobalBatchLoader
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.ddp_common import DistEnv, gather_objects
from nanochat_ext.generation.engine import Engine
from nanochat_ext.generation.sampling import SamplingConfig, sample_seed
from nanochat_ext.models.compiled import compile_stats
from nanochat_ext.tokenizer import TokenizerWrapper
from nanochat_ext.training.memory import doing
from nanochat_ext.training.tracking import Tracker, WindowSums

ZERO_STD = 1e-8  # a group whose total rewards spread less than this carries no signal


@dataclass
class Rollout:
    """Prompts with their G completions each (prompt-major) and the raw rewards of every completion."""
    indices: list[int]  # global prompt indices
    completions: list[list[int]]
    truncated: list[bool]
    rewards: torch.Tensor  # (len(indices) * G, n_rewards), float64
    sampled: list[list[int]] | None = None  # with tools: per completion token, 1 sampled, 0 forced (no loss)

    def groups(self) -> list["Rollout"]:
        """One Rollout per prompt."""
        G = len(self.completions) // max(len(self.indices), 1)
        return [Rollout([i], self.completions[j * G:(j + 1) * G], self.truncated[j * G:(j + 1) * G],
                        self.rewards[j * G:(j + 1) * G], self.sampled and self.sampled[j * G:(j + 1) * G])
                for j, i in enumerate(self.indices)]

    @staticmethod
    def concat(parts: list["Rollout"], n_rewards: int) -> "Rollout":
        with_tools = any(p.sampled is not None for p in parts)
        return Rollout([i for p in parts for i in p.indices], [c for p in parts for c in p.completions],
                       [t for p in parts for t in p.truncated],
                       torch.cat([p.rewards for p in parts]) if parts else torch.zeros(0, n_rewards, dtype=torch.float64),
                       [m for p in parts for m in p.sampled] if with_tools else None)


def zero_std_groups(total: torch.Tensor, group_size: int) -> torch.Tensor:
    """(n_groups,) bool: the groups whose total rewards are all equal (their advantages are all 0)."""
    return total.view(-1, group_size).std(dim=1, unbiased=False) < ZERO_STD


def in_global_order(parts: list[list]) -> list:
    """Every rank's share of one draw (GlobalBatchLoader's layout: rank r's j-th item is global position
    r + j*W) back in global order, the order one rank would have drawn them in."""
    per_rank = len(parts[0])
    return [parts[r][j] for j in range(per_rank) for r in range(len(parts))]


class SignalFilter:
    """DAPO's dynamic sampling: keep the groups whose rewards differ, in global draw order, until a
    global batch is full; after the last allowed draw, top up with zero-spread groups (their advantages
    are 0, so they add only the KL term) in the same order. The same draws give the same batch on any
    number of ranks."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.signal: list[Rollout] = []
        self.flat: list[Rollout] = []

    def add(self, groups: list[Rollout], flat: list[bool]) -> None:
        for g, f in zip(groups, flat):
            (self.flat if f else self.signal).append(g)

    @property
    def full(self) -> bool:
        return len(self.signal) >= self.batch_size

    def batch(self) -> tuple[list[Rollout], int]:
        """The global batch in global order, and how many zero-spread groups filled it."""
        chosen = self.signal[:self.batch_size]
        filled = self.flat[:self.batch_size - len(chosen)]
        return chosen + filled, len(filled)


FEWER_COMPLETIONS = "fewer completions per rank (--batch_size, --group_size, or more ranks)"


def grpo_window(reward_names: list[str]) -> WindowSums:
    """This rank's sums over the steps of one log window: rollouts, the loss, where the time went."""
    return WindowSums(["reward", "reward_sq", "samples", *(f"reward_{n}" for n in reward_names), "tokens",
                       "sampled_tokens", "tool_calls", "tool_errors", "truncated", "rm_cut", "zero_std", "groups", "draws", "filled", *LOSS_STATS,
                       "gen_s", "compile_s", "score_s", "ref_s", "train_s", "steps", "decoded", "decode_s",
                       "decode_bytes"])


class Rollouts:
    """The rollouts of a GRPO run on this rank: `drawn` prompt batches so far (one a step, more with
    --filter_zero_std), each sampled G times from prompt_ids with its own seeds and scored; statistics go to
    `window`."""

    def __init__(self, engine: Engine, rewards: Rewards, loader: GlobalBatchLoader, rows: list[PromptRow],
                 prompt_ids: list[list[int]], tok: TokenizerWrapper, sampling: SamplingConfig,
                 args: argparse.Namespace, env: DistEnv, autocast: ContextManager, window: WindowSums):
        self.engine, self.rewards, self.loader, self.rows, self.prompt_ids = engine, rewards, loader, rows, prompt_ids
        self.tok, self.sampling, self.args, self.env, self.autocast, self.window = tok, sampling, args, env, autocast, window
        self.G = args.group_size
        self.drawn = 0

    def next(self) -> Rollout:
        """This step's rollout: the next draw, or with --filter_zero_std the groups with a reward spread."""
        if not self.args.filter_zero_std:
            self.drawn += 1
            return self.draw(self.drawn - 1)
        ro, filled = self.with_signal()
        self.window.add(filled=filled / (self.args.batch_size * self.env.world_size))
        return ro

    def draw(self, draw: int) -> Rollout:
        """This rank's share of draw number `draw`, sampled and scored."""
        indices = [i for mb in self.loader.micro_batches(draw) for i in mb]
        prompts, seed = [self.prompt_ids[i] for i in indices], self.args.seed
        t0, compiled_before = time.time(), compile_stats()[1]
        self.engine.model.eval()
        with self.autocast, doing(f"the rollout ({len(indices) * self.G} completions of up to "
                                  f"{self.sampling.max_new_tokens} tokens)",
                                  (FEWER_COMPLETIONS, "a smaller --max_new_tokens")):
            samples = self.engine.generate(prompts, self.G, self.sampling, self.tok.stop_ids, self.tok.pad_id,
                                           [torch.Generator().manual_seed(sample_seed(seed, draw, i)) for i in indices])
        t1, compile_s = time.time(), compile_stats()[1] - compiled_before  # --compile: a new shape's compile
        decoded = self.engine.last
        with doing("scoring the rollout", (FEWER_COMPLETIONS,)):
            per_reward, rm_cut = self.rewards.score([self.rows[i] for i in indices], indices, prompts, samples,
                                                    self.tok, self.G)
        total = self.rewards.total(per_reward)
        tokens = sum(map(len, samples.completions))
        self.window.add(reward=total.sum(), reward_sq=(total * total).sum(), samples=len(total), tokens=tokens,
                        sampled_tokens=tokens if samples.sampled is None else sum(map(sum, samples.sampled)),
                        tool_calls=samples.tool_calls, tool_errors=samples.tool_errors,
                        truncated=sum(samples.truncated), rm_cut=rm_cut,
                        zero_std=zero_std_groups(total, self.G).sum(), groups=len(indices),
                        draws=1.0 / self.env.world_size, gen_s=t1 - t0 - compile_s, compile_s=compile_s,
                        score_s=time.time() - t1, decoded=decoded.rows * decoded.steps, decode_s=decoded.decode_s,
                        decode_bytes=decoded.bytes_read,
                        **{f"reward_{n}": v for n, v in zip(self.rewards.names, per_reward.sum(0).tolist())})
        return Rollout(indices, samples.completions, samples.truncated, per_reward, samples.sampled)

    def with_signal(self) -> tuple[Rollout, int]:
        """Collective, --filter_zero_std: draw until the global batch holds batch_size groups with a reward
        spread (at most --max_draws draws); every rank sees every group, then takes its share of the batch.
        Returns it and how many zero-spread groups filled it up."""
        kept = SignalFilter(self.args.batch_size)
        for _ in range(self.args.max_draws):
            groups = in_global_order(gather_objects(self.draw(self.drawn).groups()))
            self.drawn += 1
            kept.add(groups, [bool(zero_std_groups(self.rewards.total(g.rewards), self.G)) for g in groups])
            if kept.full:
                break
        batch, filled = kept.batch()
        return Rollout.concat(batch[self.env.rank::self.env.world_size], len(self.rewards.names)), filled


def log_rollouts(tracker: Tracker, step: int, ro: Rollout, total: torch.Tensor, tok: TokenizerWrapper) -> None:
    """Collective: rank 0 writes every rank's trained completions of this step, ordered by global prompt index."""
    G = len(ro.completions) // len(ro.indices)
    mine = [{"step": step, "prompt_index": i, "sample": g, "completion_ids": ro.completions[j * G + g],
             "completion": tok.decode(ro.completions[j * G + g]), "reward": float(total[j * G + g]),
             **({"sampled": ro.sampled[j * G + g]} if ro.sampled is not None else {})}
            for j, i in enumerate(ro.indices) for g in range(G)]
    rows = sorted((r for part in gather_objects(mine) for r in part), key=lambda r: (r["prompt_index"], r["sample"]))
    tracker.records("rollouts.jsonl", rows)


def window_metrics(s: dict[str, float], names: list[str], world: int, lr: float, grad_norm: float,
                   elapsed: float, peak_bw: float | None = None) -> dict:
    """Logged metrics from one window's sums over all ranks and its wall-clock seconds. Times are summed
    over ranks and every rank counted its steps, so per-step seconds divide by the step count (which is
    world x steps). Throughput is over the wall clock, so work between the timed phases counts too."""
    n, steps = s["samples"], s["steps"] / world
    mean = s["reward"] / n
    tokens = max(s["loss_tokens"], 1)
    m = {"train/reward": mean, "train/reward_std": max(s["reward_sq"] / n - mean * mean, 0.0) ** 0.5}
    m.update({f"train/reward_{name}": s[f"reward_{name}"] / n for name in names})
    # train/pg_objective: chat_rl's printed loss, -sum(A logp) / N, normalised as train/loss (grpo_loss)
    m.update({"train/loss": s["loss"] / steps, "train/pg_objective": s["pg_objective"] / steps,
              "train/kl": s["kl"] / tokens, "train/entropy": s["entropy"] / tokens,
              "train/clip_frac": s["clipped"] / tokens, "train/completion_len": s["sampled_tokens"] / n,
              # --tools: the calculator's calls per completion and the share it refused (forced tokens are in
              # gen_tokens_per_s, the decoding's work, but not in the completion length the loss sees)
              "train/tool_calls": s["tool_calls"] / n,
              "train/tool_errors": s["tool_errors"] / max(s["tool_calls"], 1),
              "train/truncated_frac": s["truncated"] / n, "train/rm_truncated_frac": s["rm_cut"] / n,
              "train/zero_std_groups": s["zero_std"] / s["groups"], "train/draws": s["draws"] / steps,
              "train/filled_frac": s["filled"] / steps, "train/lr": lr, "train/grad_norm": grad_norm,
              "perf/gen_tokens_per_s": s["tokens"] / (s["gen_s"] / world),
              "perf/completions_per_s": n / elapsed,
              "perf/train_tokens_per_s": s["loss_tokens"] / (s["train_s"] / world),
              # where a step's time goes (seconds per step, mean over ranks): the rollout share is gen + score
              **{f"perf/{phase}_s_per_step": s[f"{phase}_s"] / (steps * world) for phase in ("gen", "score", "ref", "train")},
              "perf/compile_s": s["compile_s"] / world,  # --compile: compiling new shapes, apart from gen_s
              "perf/rollout_share": (s["gen_s"] + s["score_s"]) / world / elapsed,
              # decoding as nanochat's infer_bench reports it, per rank: rows x decode steps, and the bytes those
              # steps must read over the device's peak bandwidth (MBU; where the device's peak is known)
              "perf/decode_tok_s": s["decoded"] / max(s["decode_s"], 1e-9)})
    if peak_bw:
        m["perf/decode_mbu"] = s["decode_bytes"] / max(s["decode_s"], 1e-9) / peak_bw
    return m
