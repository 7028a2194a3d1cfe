"""GRPO's rollouts on each rank: how completions are sampled (RolloutConfig), the engines that sample them
(DecodeSpec, RolloutEngines), a draw of prompts sampled and scored, DAPO's dynamic sampling over draws (the sums go
to the log window), synchronously (Rollouts) or a step ahead in a thread (RolloutsAhead), and the rollout log.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from dataclasses import InitVar, asdict, dataclass
from typing import NamedTuple

import torch

from nanochat_ext.agent.agent import Agent
from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.config import FINITE_NON_NEGATIVE, NON_NEGATIVE, POSITIVE, option
from nanochat_ext.data.batching import GlobalBatchLoader
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.ddp_common import DistEnv, gather_objects, in_group, side_group
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig, sample_seed
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.compiled import compile_stats
from nanochat_ext.runtime.progress import Progress
from nanochat_ext.tokenizer import TokenizerWrapper
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
    logprobs: list[list[float]] | None = None  # per completion token, its log-prob as the engine computed it

    def groups(self) -> list[Rollout]:
        """One Rollout per prompt."""
        G = len(self.completions) // max(len(self.indices), 1)
        return [Rollout([i], self.completions[j * G:(j + 1) * G], self.truncated[j * G:(j + 1) * G],
                        self.rewards[j * G:(j + 1) * G], self.sampled and self.sampled[j * G:(j + 1) * G],
                        self.logprobs and self.logprobs[j * G:(j + 1) * G])
                for j, i in enumerate(self.indices)]

    @staticmethod
    def concat(parts: list[Rollout], n_rewards: int) -> Rollout:
        with_tools = any(p.sampled is not None for p in parts)
        with_logprobs = bool(parts) and all(p.logprobs is not None for p in parts)
        return Rollout([i for p in parts for i in p.indices], [c for p in parts for c in p.completions],
                       [t for p in parts for t in p.truncated],
                       torch.cat([p.rewards for p in parts]) if parts
                       else torch.zeros(0, n_rewards, dtype=torch.float64),
                       [m for p in parts for m in p.sampled] if with_tools else None,
                       [lp for p in parts for lp in p.logprobs] if with_logprobs else None)


def zero_std_groups(total: torch.Tensor, group_size: int) -> torch.Tensor:
    """(n_groups,) bool: the groups that carry no signal: their total rewards all equal (their advantages are all 0),
    or one the machine failed to score (NaN: the group is left out of the loss)."""
    groups = total.view(-1, group_size)
    return (groups.std(dim=1, unbiased=False) < ZERO_STD) | groups.isnan().any(1)


def left_out(total: torch.Tensor, group_size: int) -> torch.Tensor:
    """(completions,) bool: the completions of the groups the machine failed to score one of (a NaN total: a reward
    raised errors.Unscored), which GRPO leaves out of the loss."""
    return torch.isnan(total).view(-1, group_size).any(1).repeat_interleave(group_size)


@contextmanager
def side_stream(stream: torch.cuda.Stream | None, device: torch.device) -> Iterator[None]:
    """The rollout thread's GPU work on a CUDA stream of its own (None: on CPU, nothing to do), so that its kernels can
    run beside the training's instead of queued behind them. It starts after the work the default stream holds so far
    (the weights just copied into the held engine) and ends synchronized (the next copy overwrites what it read)."""
    if stream is None:
        yield
        return
    torch.cuda.set_device(device)  # a thread's current device is its own
    stream.wait_stream(torch.cuda.default_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


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


@dataclass(frozen=True)
class RolloutConfig:
    """How GRPO samples its completions and which of them count."""
    group_size: int = option(8, "completions per prompt, G >= 2", type=int,
                             check=(lambda v: v >= 2, ">= 2 (advantages are relative to the group)"))
    max_new_tokens: int = option(512, "completion length limit (TRL's max_completion_length)", type=int,
                                 check=POSITIVE)
    min_new_tokens: int = option(0, "every stop token is held back until this many tokens", type=int,
                                 check=NON_NEGATIVE)
    temperature: float = option(1.0, "sampling temperature; the ratio, KL and entropy use the same softmax(logits / T)",
                                type=float, check=(lambda v: v > 0 and v != float("inf"),
                                                   "> 0 for training (log-probs are taken at it)"))
    top_k: int = option(0, "sample among the k likeliest tokens (0: off)", type=int, check=(lambda v: v >= 0,
                                                                                              ">= 0 (0: off)"))
    top_p: float = option(1.0, "nucleus sampling mass (1: off)", type=float, check=(lambda v: 0 < v <= 1, "in (0, 1]"))
    mask_truncated: bool = option(False, "leave completions that hit --max_new_tokens out of the loss",
                                  action="store_true")
    filter_zero_std: bool = option(False, "DAPO's dynamic sampling: drop groups whose rewards are all equal (zero "
                                          "advantage, no signal) and draw more prompts until the global batch has "
                                          "--batch_size groups that differ", action="store_true")
    max_draws: int = option(4, "with --filter_zero_std, prompt batches drawn per step at most; a batch still short "
                               "after them is topped up with zero-spread groups, logged as train/filled_frac", type=int,
                            check=POSITIVE)
    overlong_buffer: int = option(0, "DAPO's soft overlong penalty: a completion longer than max_new_tokens - N tokens "
                                     "gets -penalty x (length - (max_new_tokens - N)) / N added to its reward (0: off)",
                                  type=int)
    overlong_penalty: float = option(1.0, "the penalty at max_new_tokens, with --overlong_buffer", type=float,
                                     check=FINITE_NON_NEGATIVE)
    async_rollouts: int = option(0, "1: the next step's rollout is sampled and scored in a thread, from the weights "
                                    "this step started from, while this step trains (one step off-policy, as TRL's "
                                    "AsyncGRPO max_staleness 1; the schedule is fixed: step t's rollout comes from the "
                                    "weights after step t-2, whatever finishes first); 0: each step's from its own "
                                    "weights", type=int, choices=(0, 1))
    log_rollouts: bool = option(False, "write every completion (token ids, text, reward) of every step to "
                                       "<log_dir>/rollouts.jsonl, in global prompt order whatever the world size",
                                action="store_true")

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.min_new_tokens)

    def overlong(self) -> tuple[int, int, float] | None:
        """(max_new_tokens, buffer, penalty) for the soft overlong penalty, None when off; one line for a buffer
        longer than a completion can be."""
        if self.overlong_buffer < 0 or self.overlong_buffer > self.max_new_tokens:
            raise InputError(f"--overlong_buffer must be 0..--max_new_tokens ({self.max_new_tokens}), got "
                             f"{self.overlong_buffer}")
        return (self.max_new_tokens, self.overlong_buffer, self.overlong_penalty) if self.overlong_buffer else None


FEWER_COMPLETIONS = "fewer completions per rank (--batch_size, --group_size, or more ranks)"


class Sampled(NamedTuple):
    """A rollout in flight's result (--async_rollouts): the rollout, its statistics for the log window, its
    staleness (the updates its weights are behind) and the draws taken once it was sampled."""
    rollout: Rollout
    stats: dict
    staleness: int
    drawn: int


class RolloutEngines(NamedTuple):
    """GRPO's engines: `engine` decodes the rollouts and the evaluation, each token's log-prob kept
    (train/engine_ratio); `ahead` (--async_rollouts) decodes the next step's rollout while this step trains."""
    engine: Engine
    ahead: Engine | None


@dataclass(frozen=True)
class DecodeSpec:
    """GRPO's rollout engines, built from the policy before it is sharded (PolicyTraining's from_whole: under fsdp
    they decode from a whole copy, in `whole_in`)."""
    compile: bool
    agent: Agent | None  # the tools and environment the rollouts run with
    reserve: int  # positions: the longest prompt plus --max_new_tokens
    rollout_copy: bool = False  # --async_rollouts: the rollouts decode from a copy of the policy, refreshed when told

    def engines(self, policy: Backbone, whole_in: torch.dtype | None) -> RolloutEngines:
        engine = Engine(policy, compile=self.compile, whole_in=whole_in, agent=self.agent, reserve=self.reserve,
                        logprobs=True)
        # --async_rollouts: a second engine whose whole copy of the policy (in the masters' dtype, or the dtype FSDP
        # gathers in: the tokens of the weights it was given) decodes the next step's rollout, eagerly (torch.compile
        # and CUDA graphs in a second thread are not tested here), while this step trains
        ahead = Engine(policy, whole_in=whole_in or next(policy.parameters()).dtype, agent=self.agent,
                       reserve=self.reserve, logprobs=True, held=True) if self.rollout_copy else None
        return RolloutEngines(engine, ahead)


@dataclass(eq=False, repr=False, kw_only=True)
class Rollouts:
    """The rollouts of a GRPO run on this rank, sampled as each step asks (RolloutsAhead: in a thread, a step ahead):
    `drawn` prompt batches so far (one a step, more with --filter_zero_std), each sampled G times from prompt_ids
    with its own seeds and scored; statistics go to `window` as a step takes its rollout, the phases to `progress`."""

    engine: Engine  # the policy's: samples the rollouts and the evaluation
    rewards: Rewards
    loader: GlobalBatchLoader  # which prompts a draw takes, rank by rank
    rows: list[PromptRow]
    prompt_ids: list[list[int]]
    tok: TokenizerWrapper
    cfg: RolloutConfig
    batch_size: int  # prompts a step, over every rank
    seed: int
    env: DistEnv
    autocast: Callable[[], ContextManager]
    window: WindowSums
    progress: Progress
    drawn: int = 0

    def __post_init__(self) -> None:
        self.sampling, self.G = self.cfg.sampling(), self.cfg.group_size

    def next(self, step: int, steps: int) -> Rollout:
        """Step `step`'s rollout (of the run's `steps`): the next draw, or with --filter_zero_std the groups with a
        reward spread."""
        ro, stats, self.drawn = self.step_rollout(self.drawn)
        self.window.add(**stats)
        return ro

    def close(self) -> None:
        """Nothing runs behind a synchronous step."""

    def in_flight(self) -> dict | None:
        """The rollout started for the next step, as a checkpoint keeps it: none here."""
        return None

    def draws(self) -> int:
        """Prompt batches drawn so far: where a resumed run goes on."""
        return self.drawn

    def step_rollout(self, first: int, engine: Engine | None = None, quiet: bool = False) -> tuple[Rollout, dict, int]:
        """A step's rollout from draw number `first` on (one draw, or with --filter_zero_std as many as fill the batch
        with signal), its statistics for the log window, and the number of draws taken after it."""
        if self.cfg.filter_zero_std:
            return self.with_signal(first, engine, quiet)
        return *self.draw(first, engine, quiet), first + 1

    def draw(self, draw: int, engine: Engine | None = None, quiet: bool = False) -> tuple[Rollout, dict]:
        """This rank's share of draw number `draw`, sampled (by `engine`, default the policy's) and scored, and its
        statistics for the log window. quiet: in the rollout thread, which names no phase (the training's are)."""
        engine = engine or self.engine
        indices = [i for mb in self.loader.micro_batches(draw) for i in mb]
        prompts, seed = [self.prompt_ids[i] for i in indices], self.seed
        t0, compiled_before = time.time(), compile_stats()[1]
        if not quiet:  # the policy decodes itself; a held engine's copy is in eval mode already, the policy trains
            engine.model.eval()
        doing = (lambda what, hints: nullcontext()) if quiet else self.progress.doing
        with self.autocast(), doing(f"the rollout ({len(indices) * self.G} completions of up to "
                                    f"{self.sampling.max_new_tokens} tokens)",
                                    (FEWER_COMPLETIONS, "a smaller --max_new_tokens")):
            samples = engine.generate(prompts, self.G, self.sampling, self.tok.stop_ids, self.tok.pad_id,
                                      [torch.Generator().manual_seed(sample_seed(seed, draw, i)) for i in indices],
                                      [self.rows[i].row for i in indices])
        # --compile: a new shape's compile (the process's count: none in the thread, which decodes eagerly)
        t1, compile_s = time.time(), compile_stats()[1] - compiled_before if not quiet else 0.0
        decoded = engine.last
        with doing("scoring the rollout", (FEWER_COMPLETIONS,)):
            per_reward, rm_cut = self.rewards.score([self.rows[i] for i in indices], prompts, samples, self.tok,
                                                    self.G)
        total = self.rewards.total(per_reward)
        unscored = torch.isnan(total)  # the machine's failures (errors.Unscored): out of the loss, out of the means
        total, per_reward_sums = total.nan_to_num(0.0), per_reward.nan_to_num(0.0).sum(0)
        tokens = sum(map(len, samples.completions))
        stats = dict(reward=float(total.sum()), reward_sq=float((total * total).sum()), samples=len(total),
                     sandbox_failures=int(unscored.sum()), tokens=tokens,
                     sampled_tokens=tokens if samples.sampled is None else sum(map(sum, samples.sampled)),
                     tool_calls=samples.tool_calls, tool_errors=samples.tool_errors,
                     tool_timeouts=samples.tool_timeouts,
                     # the episodes' own counts: scoring asked the environments for their rewards since
                     env_errors=samples.episodes.env_errors if samples.episodes else 0,
                     env_timeouts=samples.episodes.env_timeouts if samples.episodes else 0,
                     late_calls=engine.agent.late.count() if engine.agent else 0,
                     turns=sum(samples.turns) if samples.turns else len(samples.completions),
                     truncated=sum(samples.truncated), rm_cut=rm_cut,
                     draws=1.0 / self.env.world_size, gen_s=t1 - t0 - compile_s, compile_s=compile_s,
                     score_s=time.time() - t1, decoded=decoded.rows * decoded.steps, row_steps=decoded.row_steps,
                     decode_s=decoded.decode_s, decode_bytes=decoded.bytes_read,
                     **{f"reward_{n}": v for n, v in zip(self.rewards.names, per_reward_sums.tolist())})
        return Rollout(indices, samples.completions, samples.truncated, per_reward, samples.sampled,
                       samples.logprobs), stats

    def with_signal(self, first: int, engine: Engine | None, quiet: bool) -> tuple[Rollout, dict, int]:
        """Collective, --filter_zero_std: draw from `first` on until the global batch holds batch_size groups with a
        reward spread (at most --max_draws draws); every rank sees every group, then takes its share of the batch.
        Returns it, the draws' statistics summed (train/filled_frac: the zero-spread groups that filled it up) and
        the number of draws taken after it."""
        kept, sums, drawn = SignalFilter(self.batch_size), {}, first
        for _ in range(self.cfg.max_draws):
            ro, stats = self.draw(drawn, engine, quiet)
            sums = {k: sums.get(k, 0) + v for k, v in stats.items()}
            groups = in_global_order(gather_objects(ro.groups()))
            drawn += 1
            kept.add(groups, [bool(zero_std_groups(self.rewards.total(g.rewards), self.G)) for g in groups])
            if kept.full:
                break
        batch, filled = kept.batch()
        sums["filled"] = filled / (self.batch_size * self.env.world_size)
        return Rollout.concat(batch[self.env.rank::self.env.world_size], len(self.rewards.names)), sums, drawn


@dataclass(eq=False, repr=False, kw_only=True)
class RolloutsAhead(Rollouts):
    """--async_rollouts 1 (`ahead`: an engine holding its own copy of the policy): step t takes the rollout sampled
    while step t-1 trained, from the weights step t-1 started from, then copies the weights step t starts from into
    that engine and starts the next step's rollout in a thread (with --filter_zero_std, all its draws); the first
    step's rollout and the next both come from the starting weights. A draw's tokens depend only on its seeds and the
    weights it was given, so the runs are the same on any number of ranks and resumed (a checkpoint holds the
    rollout in flight: `resumed`)."""

    ahead: Engine  # holds its own copy of the policy, refreshed each step
    resumed: InitVar[dict | None] = None  # a resumed run: the draw its checkpoint had in flight (grpo.in_flight)

    def __post_init__(self, resumed: dict | None) -> None:
        super().__post_init__()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self.group = side_group()  # the thread's collectives (a reward's failure)
        self.stream = torch.cuda.Stream(self.env.device) if self.env.device.type == "cuda" else None
        self.pending: Future | None = None
        if resumed is not None:
            self.pending = Future()
            self.pending.set_result(Sampled(Rollout(**resumed["rollout"]), resumed["stats"], resumed["staleness"],
                                            self.drawn))

    def next(self, step: int, steps: int) -> Rollout:
        """The rollout sampled while the last step trained (the first step's: sampled now), then the weights this
        step starts from copied into the held engine (only once that rollout is done with them) and the next step's
        started in the thread, but after the run's last step."""
        if self.pending is None:
            self.ahead.refresh()  # collective for a sharded policy's copy: every rank calls it
            self.pending = self.start(self.drawn, staleness=0)
        ro, stats, staleness, self.drawn = self.pending.result()
        self.pending = None
        if step + 1 < steps:
            self.ahead.refresh()
            self.pending = self.start(self.drawn, staleness=1)
        self.window.add(**stats, staleness=staleness)
        return ro

    def start(self, first: int, staleness: int) -> Future:
        """A step's rollout from draw `first` on, sampled and scored in the thread by the engine holding the weights
        refreshed last (--filter_zero_std's further draws too, its collectives on the thread's own group)."""
        def sample_and_score() -> Sampled:
            with in_group(self.group), side_stream(self.stream, self.env.device):
                ro, stats, drawn = self.step_rollout(first, self.ahead, quiet=True)
            return Sampled(ro, stats, staleness, drawn)

        return self.worker.submit(sample_and_score)

    def close(self) -> None:
        """The thread ended once its draw is (a run that stops keeps no draw running behind its end)."""
        self.worker.shutdown(wait=True, cancel_futures=True)

    def in_flight(self) -> dict | None:
        """The rollout started for the next step, as a checkpoint keeps it (waited for): its rollout, its statistics,
        its staleness; None where none is."""
        if self.pending is None:
            return None
        done = self.pending.result()
        return {"rollout": asdict(done.rollout), "stats": done.stats, "staleness": done.staleness}

    def draws(self) -> int:
        """Prompt batches drawn so far, the rollout in flight's included (waited for): where a resumed run goes on."""
        return self.pending.result().drawn if self.pending is not None else self.drawn


def log_rollouts(tracker: Tracker, step: int, ro: Rollout, total: torch.Tensor, tok: TokenizerWrapper) -> None:
    """Collective: rank 0 writes every rank's trained completions of this step, ordered by global prompt index."""
    G = len(ro.completions) // len(ro.indices)
    mine = [{"step": step, "prompt_index": i, "sample": g, "completion_ids": ro.completions[j * G + g],
             "completion": tok.decode(ro.completions[j * G + g]),
             "reward": None if math.isnan(total[j * G + g]) else float(total[j * G + g]),  # None: unscored
             **({"sampled": ro.sampled[j * G + g]} if ro.sampled is not None else {})}
            for j, i in enumerate(ro.indices) for g in range(G)]
    rows = sorted((r for part in gather_objects(mine) for r in part), key=lambda r: (r["prompt_index"], r["sample"]))
    tracker.records("rollouts.jsonl", rows)
