"""Advantage estimators over a rollout's rewards, G completions per prompt (prompt-major): GRPO's group-relative
advantages and RLOO's leave-one-out ones (one per completion), scaled by the group's or the whole global batch's spread
(one all-reduce), or not at all; REINFORCE++'s per-token returns (OpenRLHF's), the KL to the reference a penalty in
the reward, whitened over the global batch's tokens; on-policy distillation's per-token reverse KL to a teacher (the
Tinker cookbook's). The same rewards give the same advantages on any number of ranks."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.ddp_common import all_reduce_sum
from nanochat_ext.errors import InputError

KL_ESTIMATORS = ("k1", "k2", "k3")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads of a step: the rewards (one per completion, prompt-major, G a prompt), --scale_rewards
    and --std_mode, the batch (its mask, pi_old's log-probs engine_logp, the reference's ref_logp or the teacher's
    teacher_logp), the coefficient of a KL in the reward (or distillation's), the KL estimator, distillation's
    discount, and the completions whose groups are in the loss (kept; None: all)."""
    rewards: torch.Tensor
    group_size: int
    scale: str = "none"
    std_mode: str = "sample"
    batch: RolloutBatch | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    discount: float = 0.0
    kept: torch.Tensor | None = None


@dataclass(frozen=True)
class Estimator:
    """What an advantage estimator is, so that flag combinations are checked from what it does, not from its name:
    where --beta's KL goes, whether a group of equal rewards gets zero advantages, which --scale_rewards it reads and
    its reference's default; and how it computes: its advantages, one per completion (n,) or per token (n, T), from
    the step's AdvantageInputs, the same on any number of ranks (a batch-wide statistic all-reduced)."""
    kl_in_reward: bool  # --beta weighs a per-completion or per-token KL in the reward (else in the loss, or none)
    centred_in_group: bool  # r minus its group's baseline, nothing else: equal rewards give zero advantages
    scalings: tuple[str, ...]  # the --scale_rewards it reads (none: it scales its own way)
    default_scale: str | None  # where --scale_rewards is not given: its reference's own default
    reference: str  # whose code its default follows
    compute: Callable[[AdvantageInputs], torch.Tensor]

    def zero_when_rewards_equal(self, beta: float) -> bool:
        """Whether a group whose task rewards are all equal has zero advantages (what --filter_zero_std and
        train/zero_std_groups read): a baseline and no KL in the reward to tell the group's members apart."""
        return self.centred_in_group and not (self.kl_in_reward and beta > 0)


STD_MODES = ("sample", "population")
ADV_EPS = 1e-4


def batch_mean_std(x: torch.Tensor, std_mode: str,
                   kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of x over the global batch (every rank's x), in one all-reduce; kept: the elements counted (a
    group left out of the loss, errors.Unscored, is not part of the batch's spread)."""
    if kept is not None:
        x = x.reshape(-1)[kept.reshape(-1)]
    stats = all_reduce_sum(torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)]))
    n = stats[2].clamp(min=1)  # no element kept anywhere (every group left out): zeros, not 0/0
    mean = stats[0] / n
    var = (stats[1] / n - mean * mean).clamp(min=0)
    if std_mode == "sample":
        var = var * n / (n - 1).clamp(min=1)
    return mean, var.sqrt()


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, std_mode: str = "sample",
                     kept: torch.Tensor | None = None) -> torch.Tensor:
    """(r - group mean) / (std + eps): std of the group ('group'), of the whole global batch ('batch',
    one all-reduce), or no scaling ('none'). std_mode 'sample' divides the squared deviations by n - 1
    (TRL, torch.std), 'population' by n (1.41x larger advantages at G=2). A group whose rewards are all
    equal gets 0, not NaN. kept: the completions 'batch' counts (None: all)."""
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}")
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        std = r.std(dim=1, keepdim=True, unbiased=std_mode == "sample")
        return (centred / (std + ADV_EPS)).view(-1).float()
    if scale == "batch":
        return (centred / (batch_mean_std(r, std_mode, kept)[1] + ADV_EPS)).view(-1).float()
    if scale == "none":
        return centred.view(-1).float()
    raise ValueError(f"unknown scale_rewards {scale!r}")


def rloo_advantages(rewards: torch.Tensor, group_size: int, scale: str, std_mode: str = "sample",
                    kept: torch.Tensor | None = None) -> torch.Tensor:
    """r minus the mean of the other G - 1 rewards of its group (G / (G - 1) times r minus the group's mean);
    'none' leaves it so (TRL's RLOOTrainer by default), 'batch' centres and divides it by the spread of the whole
    global batch's advantages (TRL's normalize_advantages; kept: the completions it counts), 'group' divides it by the
    std of its group's rewards."""
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}")
    if group_size < 2:
        raise ValueError("RLOO's baseline needs --group_size 2 or more")
    r = rewards.double().view(-1, group_size)
    loo = r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    if scale == "group":
        return (loo / (r.std(dim=1, keepdim=True, unbiased=std_mode == "sample") + ADV_EPS)).view(-1).float()
    if scale == "batch":
        mean, std = batch_mean_std(loo, std_mode, kept)
        return ((loo - mean) / (std + ADV_EPS)).view(-1).float()
    if scale == "none":
        return loo.view(-1).float()
    raise ValueError(f"unknown scale_rewards {scale!r}")


def approx_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimates from log-probs of the sampled tokens (Schulman's k1, k2, k3), clamped to [-10, 10] as
    OpenRLHF's compute_approx_kl does."""
    d = logp.double() - ref_logp.double()
    if estimator == "k2":
        d = d * d / 2
    elif estimator == "k3":
        d = (-d).exp() - 1 + d
    elif estimator != "k1":
        raise ValueError(f"unknown kl_estimator {estimator!r}")
    return d.clamp(min=-10, max=10)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """Each completion's KL to the reference, its scored tokens' estimates summed: RLOO's penalty in the reward (TRL's
    RLOOTrainer, k1 as the RLOO paper: it can be negative)."""
    return (approx_kl(logp, ref_logp, estimator) * (mask > 0)).sum(1)


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, old_logp: torch.Tensor,
                            ref_logp: torch.Tensor | None, mask: torch.Tensor, kl_coef: float, kl_estimator: str,
                            baseline: bool) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025; OpenRLHF's 'reinforce', and with baseline its 'reinforce_baseline', which first
    subtracts the group's mean reward): each token's reward is -kl_coef x its KL to the reference (kl_estimator, from
    pi_old's log-probs) plus, at a completion's last scored token, the completion's reward; a token's advantage is the
    sum of the rewards from it on (gamma 1), whitened over every scored token of the global batch (one all-reduce).
    Returns (completions, tokens)."""
    r = rewards.double().view(-1, group_size)
    if baseline:
        r = r - r.mean(dim=1, keepdim=True)
    scored = (mask > 0).double()
    per_token = torch.zeros_like(scored)
    if ref_logp is not None and kl_coef > 0:
        per_token = -kl_coef * approx_kl(old_logp, ref_logp, kl_estimator)
    last = mask.size(1) - 1 - (mask > 0).long().fliplr().argmax(dim=1)
    per_token[torch.arange(mask.size(0)), last] += r.reshape(-1)
    returns = (per_token * scored).flip(1).cumsum(1).flip(1)
    stats = all_reduce_sum(torch.stack([(returns * scored).sum(), (returns * returns * scored).sum(), scored.sum()]))
    mean = stats[0] / stats[2].clamp(min=1)
    var = stats[1] / stats[2].clamp(min=1) - mean * mean
    return ((returns - mean) * var.clamp(min=1e-8).rsqrt()).float()


def distill_advantages(rewards: torch.Tensor, group_size: int, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       mask: torch.Tensor, coef: float, discount: float) -> torch.Tensor:
    """On-policy distillation (Thinking Machines 2025, the Tinker cookbook's recipe): each token's advantage is its
    completion's reward minus the group's mean (0 where the run has no reward), minus coef x the token's reverse KL to
    the teacher, the student's log-prob of the token it sampled minus the teacher's, summed over the tokens from it on
    with `discount` (0: the token's own alone). Only the teacher's log-prob of the sampled token: no full-vocabulary
    KL. Returns (completions, tokens)."""
    r = rewards.double().view(-1, group_size)
    centred = (r - r.mean(dim=1, keepdim=True)).reshape(-1, 1)
    penalty = -coef * (student_logp.double() - teacher_logp.double()) * (mask > 0).double()
    if discount > 0:
        running = torch.zeros_like(penalty[:, 0])
        for t in range(penalty.size(1) - 1, -1, -1):
            running = penalty[:, t] + discount * running
            penalty[:, t] = running
    return (centred + penalty).float()


def advantages(estimator: str, rewards: torch.Tensor, group_size: int, scale: str, std_mode: str = "sample",
               batch: RolloutBatch | None = None, kl_coef: float = 0.0, kl_estimator: str = "k1",
               discount: float = 0.0, kept: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages --advantage names (a key of ESTIMATORS): one per completion, or REINFORCE++'s and
    distillation's per token, which read the batch's mask, pi_old's log-probs (the engine's, engine_logp) and the
    reference's (ref_logp) or the teacher's (teacher_logp); kl_coef: the coefficient of the KL in the reward
    (RLOO's, REINFORCE++'s; none without ref_logp) or distillation's; kept: the completions whose groups are in the
    loss (a batch-wide scaling counts only them; REINFORCE++ counts the mask's tokens)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage {estimator!r}")
    return ESTIMATORS[estimator].compute(AdvantageInputs(rewards, group_size, scale, std_mode, batch, kl_coef,
                                                         kl_estimator, discount, kept))


def _rloo(x: AdvantageInputs) -> torch.Tensor:
    """RLOO's leave-one-out advantages, of the rewards less beta x each completion's KL where the batch has the
    reference's log-probs (TRL's RLOOTrainer)."""
    rewards = x.rewards
    if x.batch is not None and x.batch.ref_logp is not None and x.kl_coef > 0:
        rewards = rewards.double() - x.kl_coef * sequence_kl(x.batch.engine_logp, x.batch.ref_logp, x.batch.mask,
                                                             x.kl_estimator)
    return rloo_advantages(rewards, x.group_size, x.scale, x.std_mode, x.kept)


def _reinforce_pp(baseline: bool) -> Callable[[AdvantageInputs], torch.Tensor]:
    return lambda x: reinforce_pp_advantages(x.rewards, x.group_size, x.batch.engine_logp, x.batch.ref_logp,
                                             x.batch.mask, x.kl_coef, x.kl_estimator, baseline)


# The estimators --advantage names, each declaring what it is (the flags' checks read it) and computing its own.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(False, True, SCALE_REWARDS, "group", "TRL's GRPOTrainer: scale_rewards='group'",
                      lambda x: group_advantages(x.rewards, x.group_size, x.scale, x.std_mode, x.kept)),
    "rloo": Estimator(True, True, SCALE_REWARDS, "none", "TRL's RLOOTrainer: normalize_advantages=False", _rloo),
    "reinforce_pp": Estimator(True, False, (), None, "OpenRLHF's reinforce: no baseline, whitened over the batch",
                              _reinforce_pp(False)),
    "reinforce_pp_baseline": Estimator(True, False, (), None, "OpenRLHF's reinforce_baseline: whitened over the "
                                                              "batch, so a group of equal rewards is not zero",
                                       _reinforce_pp(True)),
    "distill": Estimator(False, False, (), None, "the Tinker cookbook: each token's reverse KL to the teacher",
                         lambda x: distill_advantages(x.rewards, x.group_size, x.batch.engine_logp,
                                                      x.batch.teacher_logp, x.batch.mask, x.kl_coef,
                                                      x.discount)),
}


BUILT_IN = tuple(ESTIMATORS)


def register_estimator(name: str, estimator: Estimator) -> Estimator:
    """A new --advantage NAME from Python (api.train_grpo's advantage=NAME, or a script of your own that registers
    before it parses its flags; every rank registers the same): its declarations check the flags it meets as the
    built-ins' do, and its compute gives the step's advantages. Registering a name again replaces it (a notebook's
    cell run twice); a built-in's name, or a default --scale_rewards it does not read, is refused."""
    if name in BUILT_IN:
        raise InputError(f"--advantage {name} is a built-in estimator: give yours another name")
    if estimator.default_scale is not None and estimator.default_scale not in estimator.scalings:
        raise InputError(f"--advantage {name}: its default_scale {estimator.default_scale!r} is not one of the "
                         f"scalings it reads {estimator.scalings}")
    ESTIMATORS[name] = estimator
    return estimator


def unregister_estimator(name: str) -> None:
    """register_estimator's NAME no longer an --advantage (a built-in stays)."""
    if name not in BUILT_IN:
        ESTIMATORS.pop(name, None)
