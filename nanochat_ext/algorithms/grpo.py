"""GRPO: the clipped-surrogate + KL loss with aggregation normalised by global counts, and the method the loop runs,
its step and evaluation (its batch: rollout_batch.py; completion log-probs and the frozen reference: logprobs.py;
rollouts, their engines and dynamic sampling: rollouts.py; rewards: rewards.py; advantages: advantages.py; the
logged metrics: grpo_metrics.py).

A rollout batch on one rank is `n` prompts x G samples, prompt-major (prompt i owns rows i*G..i*G+G-1);
a group never spans ranks.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from nanochat_ext.algorithms.advantages import advantages, sequence_kl
from nanochat_ext.algorithms.evaluation import EvalConfig, evaluate_pass_k, evaluate_rewards
from nanochat_ext.algorithms.grpo_config import GRPOConfig, LossConfig
from nanochat_ext.algorithms.grpo_metrics import WINDOW, Window, window_metrics
from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.algorithms.rollouts import (
    FEWER_COMPLETIONS,
    ZERO_STD,
    Rollout,
    RolloutConfig,
    RolloutEngines,
    Rollouts,
    RolloutsAhead,
    in_global_order,
    left_out,
    log_rollouts,
)
from nanochat_ext.config import NO, TrainerSpec
from nanochat_ext.data.batching import GlobalBatchLoader
from nanochat_ext.data.rows import PromptRow
from nanochat_ext.ddp_common import DistEnv, all_reduce_sum, gather_objects
from nanochat_ext.engine.cost import peak_bandwidth
from nanochat_ext.models.lora import dropout_active
from nanochat_ext.runtime.oom import smaller_micro
from nanochat_ext.runtime.progress import Phase, Progress
from nanochat_ext.training.logprobs import CompletionLogprobs, accumulate_backward, make_sequences, token_logprobs
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import StepMemory
from nanochat_ext.training.optim import SCHEDULED
from nanochat_ext.training.setup import PolicyTraining
from nanochat_ext.training.tracking import Tracker, WindowSums

SPEC = TrainerSpec(
    name="grpo", kind="grpo_policy", script="kat_train_grpo", wrote="a GRPO policy",
    model_flag=("--policy", "the model to train"),
    # TRL 1.16's GRPOTrainer lr
    defaults={"batch_size": 8, "max_steps": None, "num_epochs": None, "optimizer": "adamw", "lr": 1e-6,
              "warmup_steps": 0, "lr_decay": "cosine", "log_every": 1, "eval_every": 0, "density": None,
              "val_ratio": 0.1, "max_len": NO},
    words={"unit": "prompts", "micro_unit": "sequences", "model": "policy", "steps": "rollout steps",
           "max_steps": "--num_epochs's, else 100",
           "epochs": " (steps' worth of batches: dynamic sampling may draw more)", "seeds": " and sampling",
           "responses": "completions", "at_most": "", "val_ratio": " where no --eval_prompts",
           "stage_dir": "chatrl_checkpoints",
           "tag": "'density' with --density, else 'uniform' (--preset chat_rl: d<depth>)", "lr": "1e-6, TRL's",
           **SCHEDULED},
    lr_cliff=(1e-4, "held-out greedy accuracy fell to 0.016 from the model's 0.109 in 40 steps, where 3e-5 reached "
                    "0.578"))

# ---- loss ---------------------------------------------------------------------------------------
def loss_normaliser(mask: torch.Tensor, weights: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """This rank's share of the denominator. weights: one per sequence (density weight of its prompt)."""
    if cfg.loss_agg == "token":
        return (mask * weights[:, None]).sum().double()
    # Per-completion aggregations count every completion, masked ones too (--mask_truncated zeroes
    # their tokens, not their place in the batch): dr_grpo's normaliser stays the constant
    # completions x max_new_tokens, as in TRL and the Dr. GRPO paper.
    if cfg.loss_agg == "sequence":
        return weights.sum().double()
    if cfg.loss_agg == "dr_grpo":
        return weights.sum().double() * cfg.max_new_tokens
    raise ValueError(f"unknown loss_agg {cfg.loss_agg!r}")


def engine_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
                   ) -> torch.Tensor:
    """--engine_correction's weight of each token's surrogate, (B, T) or (B, 1): pi_old / pi_engine per token, or
    their product over a completion's scored tokens, truncated to [clip_min, clip_max] or 0 outside it (as TRL
    weights its loss by vLLM's)."""
    gap = ((old_logp - engine_logp) * mask).detach()
    if cfg.engine_correction.startswith("sequence"):
        gap = gap.sum(1, keepdim=True)
    ratio = gap.exp()
    if cfg.engine_correction.endswith("truncate"):
        return ratio.clamp(min=cfg.engine_clip_min, max=cfg.engine_clip_max)
    low = cfg.engine_clip_min if cfg.engine_clip_min is not None else -math.inf
    high = cfg.engine_clip_max if cfg.engine_clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, weights: torch.Tensor, cfg: LossConfig, normaliser: float,
              engine_logp: torch.Tensor | None = None):
    """Clipped surrogate + beta * KL(k3) per token, aggregated as cfg.loss_agg and divided by the
    global normaliser. Returns (loss, stats) with stats = [kl sum, clipped tokens, tokens, pg objective] on this
    rank, the last -sum(A logp) / normaliser aggregated as the loss (chat_rl's printed loss, normalised as ours).

    importance_level 'token': a ratio per token, pi(y_t) / pi_old(y_t) (GRPO). 'sequence' (GSPO): one
    ratio per completion, the geometric mean of its token ratios exp(mean_t log(pi / pi_old)), clipped
    as a whole, so a completion's tokens are all kept or all clipped; 'sequence_product': their product (TRL's
    RLOO). engine_logp (with cfg.engine_correction): the surrogate weighted by engine_weights."""
    log_ratio = logp - old_logp
    if cfg.importance_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    elif cfg.importance_level == "sequence_product":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True).expand_as(logp)
    elif cfg.importance_level != "token":
        raise ValueError(f"unknown importance_level {cfg.importance_level!r}")
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # per completion, or per token (REINFORCE++)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
    per_token = -surrogate
    if cfg.engine_correction != "none":
        per_token = per_token * engine_weights(old_logp, engine_logp, mask, cfg)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.beta > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + cfg.beta * kl
    w = weights[:, None] * mask

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        if cfg.loss_agg == "sequence":
            per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
            return (weights * per_seq).sum() / normaliser
        return (per_token * w).sum() / normaliser

    loss = aggregate(per_token)
    with torch.no_grad():
        clipped = ((ratio < 1 - cfg.clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        # On-policy our loss is -sum(A)/N (the ratio is 1), whose gradient is this objective's: the same step, but
        # only this one is the curve chat_rl prints
        pg_objective = aggregate(-adv * logp.detach().float())
        stats = torch.stack([(kl * mask).sum(), (clipped.float() * mask).sum(), mask.sum(), pg_objective])
    return loss, stats.double().cpu()


# policy_backward's, in order; the engine's are sums over the scored tokens of pi_old's log-prob minus the engine's
# (exp, |.|, the tokens where that ratio is past 2x either way): the first update's log-probs, whichever update
def per_token(values: list[list[float]], shape: torch.Size) -> torch.Tensor:
    """Each completion's per-token values (the engine's log-probs) in a batch's (completions, tokens) layout."""
    out = torch.zeros(shape)
    for row, v in enumerate(values):
        out[row, :len(v)] = torch.tensor(v)
    return out


def engine_gap(b: RolloutBatch, logp: torch.Tensor) -> torch.Tensor:
    """The engine's LOSS_STATS sums over a micro-batch's scored tokens (zeros without engine_logp); logp: pi_old,
    the first update's log-probs in every update."""
    if b.engine_logp is None:
        return torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        scored = b.mask > 0
        gap = torch.where(scored, logp.detach().double() - b.engine_logp.double(), 0.0)
        return torch.stack([(gap.exp() * scored).sum(), gap.abs().sum(), (gap.abs() > FAR).sum(), scored.sum()]
                           ).double().cpu()


LOSS_STATS = ("loss", "kl", "clipped", "loss_tokens", "pg_objective", "entropy", "engine_ratio", "engine_logp_diff",
              "engine_far", "engine_tokens")
FAR = math.log(2.0)  # train/engine_far: a token whose trainer/engine ratio is past 2x either way


def policy_backward(model: nn.Module, batch: RolloutBatch, micro: int, cfg: LossConfig,
                    device: torch.device, autocast: contextlib.AbstractContextManager,
                    keep_old: bool = False) -> torch.Tensor:
    """One GRPO optimizer step's forward + backward on this rank, normalised over the global batch
    (denominator summed before any backward). Returns [loss, kl sum, clipped tokens, tokens, pg objective, entropy
    sum, the engine's sums] (LOSS_STATS; the engine's where the batch has engine_logp, the log-prob of each token
    as the rollout engine computed it: how far the trainer's log-probs are from those the tokens were sampled with).
    pi_old is batch.old_logp where the batch has it, else this pass's own log-probs (the ratio is 1). keep_old
    (the first of --num_iterations updates): the batch keeps them as old_logp for its later updates. They are the
    training graph's log-probs, dropout included, not a separate no-grad pass's, which compiled (inductor fuses the
    two graphs apart) and in bf16 differ from them by rounding (up to 0.06 on CPU's bf16: a first ratio off 1)."""
    normaliser = all_reduce_sum(loss_normaliser(batch.mask, batch.weights, cfg)).item()
    normaliser = max(normaliser, 1e-8)  # every completion masked: the loss is 0, not NaN
    olds = [] if keep_old and batch.old_logp is None else None

    def loss_fn(b: RolloutBatch, logp, entropy):
        old = b.old_logp if b.old_logp is not None else logp.detach()
        if olds is not None:
            olds.append(old.float().cpu())
        loss, stats = grpo_loss(logp, old, b.ref_logp, b.advantages, b.mask, b.weights, cfg, normaliser,
                                b.engine_logp)
        return loss, torch.cat([stats, (entropy * b.mask).sum().double().cpu().view(1), engine_gap(b, old)])

    total = accumulate_backward(model, batch, micro, device, autocast, loss_fn)
    if olds is not None:
        batch.old_logp = torch.zeros(batch.target.shape)
        row = 0
        for old in olds:  # micro-batches in order, each cut to its own longest completion
            batch.old_logp[row:row + old.size(0), :old.size(1)] = old
            row += old.size(0)
    return total

def zero_advantage_groups(adv: torch.Tensor, mask: torch.Tensor, group_size: int) -> int:
    """train/zero_std_groups' count: the groups whose advantages are zero on every token the loss sees (per
    completion, or per token for REINFORCE++ and distillation): the groups that carry no signal, whatever the
    estimator (RLOO's KL in the reward, REINFORCE++'s whitening make a group of equal rewards carry some)."""
    per_token = adv if adv.dim() == 2 else adv[:, None].expand_as(mask)
    moved = ((per_token.abs() > ZERO_STD) & (mask > 0)).any(1)
    return int((~moved.view(-1, group_size).any(1)).sum())


# ---- the method -----------------------------------------------------------------------------------
# What a checkpoint written before these flags existed was trained with.
PRE_DAPO_DEFAULTS = {"std_mode": "population", "importance_level": "token", "filter_zero_std": False,
                     "advantage": "grpo", "optimizer": "adamw", "tools": "none", "env": None, "tool_format": "auto",
                     "max_turns": 8, "teacher": None, "kl_estimator": "k1", "async_rollouts": 0}
# The flags a resumed run must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "group_size", "seed", "loss_agg", "max_new_tokens", "std_mode", "advantage",
                "importance_level", "filter_zero_std", "optimizer", "tools", "env", "tool_format", "max_turns",
                "teacher", "kl_estimator", "async_rollouts")


@dataclass
class Prompts:
    """A split of GRPO's prompts: their rows and their token ids."""
    rows: list[PromptRow]
    ids: list[list[int]]


class GRPO:
    """The GRPO method of the loop (training/loop.py): a step samples and scores a rollout (rollouts.py), takes its
    group-relative advantages and the reference's log-probs, and --num_iterations clipped-surrogate updates in
    micro-batches of `micro` sequences; the evaluation decodes the held-out prompts greedy and sampled (pass@k with
    --eval_pass_k)."""
    name = SPEC.name
    headline = ("train/reward", "train/reward_std", "train/loss", "train/kl", "train/completion_len",
                "train/zero_std_groups", "perf/completions_per_s")  # its step line (--log_line short)

    def __init__(self, training: PolicyTraining, cfg: GRPOConfig, rollout: RolloutConfig, evaluation: EvalConfig,
                 rewards: Rewards, train: Prompts, held_out: Prompts, loader: GlobalBatchLoader, seed: int,
                 micro: int, estimate: StepMemory, progress: Progress, engines: RolloutEngines,
                 teacher: CompletionLogprobs | None = None):
        self.training, self.cfg, self.rollout, self.eval_cfg, self.rewards = training, cfg, rollout, evaluation, rewards
        self.engine = engines.engine  # the rollouts' and the evaluation's
        self.teacher = teacher  # --advantage distill: the frozen teacher whose log-probs the policy learns
        self.train, self.held_out, self.seed, self.micro, self.estimate = train, held_out, seed, micro, estimate
        self.G, self.loss = rollout.group_size, cfg.loss(rollout.max_new_tokens)
        self.share = loader.plan.per_rank * self.G  # this rank's sequences a step
        self.window = WindowSums([*WINDOW, *(f"reward_{n}" for n in rewards.names)])
        self.clock_noted = False
        env = training.env
        source = dict(engine=engines.engine, rewards=rewards, loader=loader, rows=train.rows, prompt_ids=train.ids,
                      tok=training.tok, cfg=rollout, batch_size=loader.plan.batch_size, seed=seed, env=env,
                      autocast=training.fresh_autocast, window=self.window, progress=progress,
                      drawn=int(training.resumed.get("draw", training.resumed.get("step", 0))))
        if engines.ahead is None:
            self.rollouts = Rollouts(**source)
        else:
            self.rollouts = RolloutsAhead(**source, ahead=engines.ahead, resumed=in_flight(training.resumed, env))
        self.peak_bw = peak_bandwidth(env.device)
        # no reward (distillation alone): nothing scores the held-out completions, so none are decoded
        self.evaluation = Phase(f"the evaluation ({self.share} completions of up to {rollout.max_new_tokens} tokens at "
                                f"a time)",
                                (FEWER_COMPLETIONS, "a smaller --max_new_tokens")) if rewards.names else None

    def step(self, step: int, loop: Loop) -> None:
        """Rollout, score, the frozen models' log-probs, advantages, --num_iterations updates."""
        ro = self.rollouts.next(step, loop.cfg.max_steps)
        total = self.rewards.total(ro.rewards)
        if self.rollout.log_rollouts:
            log_rollouts(loop.tracker, step + 1, ro, total, self.training.tok)
        batch = self.rollout_batch(ro)
        unscored = left_out(total, self.G)  # groups the machine failed to score one of (errors.Unscored)
        batch.mask[unscored], total = 0.0, total.masked_fill(unscored, 0.0)  # no tokens, no advantage
        t0 = time.time()
        self.frozen_logprobs(batch, loop)
        batch.advantages = self.compute_advantages(batch, total, kept=~unscored)
        self.window.add(zero_std=zero_advantage_groups(batch.advantages, batch.mask, self.G), groups=len(ro.indices))
        t1 = time.time()
        stats = self.update(batch, loop)
        self.window.add(**dict(zip(LOSS_STATS, stats.tolist())), ref_s=t1 - t0, train_s=time.time() - t1)

    def rollout_batch(self, ro: Rollout) -> RolloutBatch:
        """The rollout's completions as the trainer batches them, with their prompts' weights and the engine's
        log-probs. A group's prompt can be computed once for its G completions (PrefixTree rows) when micro-batches
        hold whole groups; the model does so where that is cheaper. Same log-probs as one row per completion."""
        G = self.G
        batch = RolloutBatch.of(make_sequences([self.train.ids[i] for i in ro.indices], ro.completions, G,
                                               self.training.tok.pad_id, self.micro % G == 0, ro.sampled),
                                weights=torch.tensor([self.train.rows[i].weight for i in ro.indices],
                                                     dtype=torch.float32).repeat_interleave(G))
        if ro.logprobs is not None:  # the first update's log-probs against them: train/engine_ratio
            batch.engine_logp = per_token(ro.logprobs, batch.target.shape)
        if self.rollout.mask_truncated:
            batch.mask[torch.tensor(ro.truncated)] = 0.0
        return batch

    def frozen_logprobs(self, batch: RolloutBatch, loop: Loop) -> None:
        """The reference's log-probs (pi_old is the first update's own: policy_backward) and the teacher's, and the
        KL each logs: train/teacher_kl, and train/kl where the KL is in the reward (as TRL and OpenRLHF log it)."""
        t, micro = self.training, self.micro
        with loop.progress.doing(f"log-probs without gradients, {micro} sequences at a time",
                                 smaller_micro(micro, self.share)):
            if t.reference is not None:
                batch.ref_logp = token_logprobs(t.reference, batch, micro, t.env.device, t.autocast)
            if self.teacher is not None:
                batch.teacher_logp = token_logprobs(self.teacher, batch, micro, t.env.device, t.autocast)
                scored = batch.mask > 0  # the reverse KL of each sampled token
                reverse_kl = (batch.engine_logp.double() - batch.teacher_logp) * scored
                self.window.add(teacher_kl=float(reverse_kl.sum()), teacher_tokens=float(scored.sum()))
        if batch.ref_logp is not None and self.cfg.kl_in_reward:
            kl = sequence_kl(batch.engine_logp, batch.ref_logp, batch.mask, self.cfg.kl_estimator)
            self.window.add(kl=float(kl.sum()))  # over the loss's tokens

    def compute_advantages(self, batch: RolloutBatch, total: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """--advantage's estimator over the total rewards. The coefficient it reads: distillation's, or beta where
        the KL is in the reward (in the loss otherwise: an estimator must not weigh it twice)."""
        cfg = self.cfg
        coef = cfg.teacher_coef if cfg.advantage == "distill" else cfg.beta if cfg.kl_in_reward else 0.0
        return advantages(cfg.advantage, total, self.G, cfg.scaling, cfg.std_mode, batch, coef, cfg.kl_estimator,
                          cfg.teacher_discount, kept=kept)

    def update(self, batch: RolloutBatch, loop: Loop) -> torch.Tensor:
        """--num_iterations clipped-surrogate updates on the batch; their LOSS_STATS, averaged."""
        t, micro = self.training, self.micro
        stats = torch.zeros(len(LOSS_STATS), dtype=torch.float64)
        for iteration in range(self.cfg.num_iterations):
            with loop.progress.doing(f"a training micro-batch of {micro} sequences",
                                     t.training_hints(micro, self.share)), dropout_active(t.policy):
                it = policy_backward(t.ddp_model, batch, micro, self.loss, t.env.device, t.autocast,
                                     keep_old=iteration == 0 and self.cfg.num_iterations > 1)
            loop.update(it[0].item())
            stats += it
        return stats / self.cfg.num_iterations

    def metrics(self, s: dict[str, float], elapsed: float) -> dict[str, float]:
        timeouts = int(s["tool_timeouts"] + s["env_timeouts"])
        if timeouts and not self.clock_noted and self.training.env.is_main:  # once a run: what it costs exactness
            limit = self.engine.agent.cfg.tool_timeout
            print(f"note: {timeouts} tool or environment calls ran past --tool_timeout {limit:g} s "
                  f"(train/tool_timeouts, train/env_timeouts): a rollout with such a call depends on the clock, so "
                  f"this run is not exactly the same on other ranks or when resumed", flush=True)
            self.clock_noted = True
        return window_metrics(Window(s, self.training.env.world_size, elapsed, self.peak_bw, tuple(self.rewards.names),
                                     bool(self.rollout.async_rollouts)))

    def evaluate(self, done: int, tracker: Tracker) -> dict[str, float]:
        """Collective: the held-out rewards (evaluate_rewards) and, with --eval_pass_k, pass@k, decoding at most a
        rollout's rows at a time; rank 0 shows its first greedy completions."""
        if not self.held_out.rows:
            return {}
        t, held, sampling = self.training, self.held_out, self.rollout.sampling()
        metrics, shown = evaluate_rewards(self.engine, held.rows, held.ids, self.rewards, t.tok, sampling, self.seed,
                                          t.env, t.autocast, self.share)
        for i, (prompt, completion) in enumerate(shown):
            tracker.text(done, f"eval/sample_{i}", f"**prompt:** {prompt}\n\n**completion:** {completion}")
        if self.eval_cfg.eval_pass_k:
            metrics.update(evaluate_pass_k(self.engine, held.rows, held.ids, self.rewards, t.tok, sampling,
                                           self.eval_cfg.eval_pass_k, self.seed, t.env, t.autocast, self.share))
        return metrics

    def close(self) -> None:
        """The run is over, or failed: the rollout thread (--async_rollouts) ended."""
        self.rollouts.close()

    def resume_state(self) -> dict:
        """Collective with --async_rollouts: every rank's draw in flight,
        in global order (any world size resumes it)."""
        mine = self.rollouts.in_flight()
        state = {"draw": self.rollouts.draws(), "device_batch_size": self.micro}
        if mine is not None:
            parts = gather_objects(mine)
            groups = in_global_order([Rollout(**p["rollout"]).groups() for p in parts])
            stats = {k: sum(p["stats"][k] for p in parts) for k in mine["stats"]}  # summed over ranks, as logged
            state["in_flight"] = {"groups": [asdict(g) for g in groups], "stats": stats,
                                  "staleness": mine["staleness"], "n_rewards": len(self.rewards.names)}
        return state


def in_flight(resumed: dict, env: DistEnv) -> dict | None:
    """This rank's share of the draw a checkpoint had in flight (--async_rollouts), as RolloutsAhead takes it: its
    groups by the rank's layout (GlobalBatchLoader's: rank r holds positions r, r + W, ...), the window's sums on
    rank 0."""
    saved = resumed.get("in_flight")
    if saved is None:
        return None
    mine = Rollout.concat([Rollout(**g) for g in saved["groups"][env.rank::env.world_size]], saved["n_rewards"])
    stats = saved["stats"] if env.rank == 0 else {k: 0.0 for k in saved["stats"]}
    return {"rollout": asdict(mine), "stats": stats, "staleness": saved["staleness"]}
