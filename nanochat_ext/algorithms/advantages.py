"""Advantage estimators over a rollout's rewards, G completions per prompt (prompt-major): GRPO's group-relative
advantages and RLOO's leave-one-out ones, scaled by the group's or the whole global batch's spread (one all-reduce),
or not at all. The same rewards give the same advantages on any number of ranks."""
from __future__ import annotations

import torch

from nanochat_ext.ddp_common import all_reduce_sum

ADVANTAGES = ("grpo", "rloo")
SCALE_REWARDS = ("group", "batch", "none")
STD_MODES = ("sample", "population")
ADV_EPS = 1e-4


def batch_mean_std(x: torch.Tensor, std_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of x over the global batch (every rank's x), in one all-reduce."""
    stats = all_reduce_sum(torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)]))
    n = stats[2]
    mean = stats[0] / n
    var = (stats[1] / n - mean * mean).clamp(min=0)
    if std_mode == "sample":
        var = var * n / (n - 1).clamp(min=1)
    return mean, var.sqrt()


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, std_mode: str = "sample") -> torch.Tensor:
    """(r - group mean) / (std + eps): std of the group ('group'), of the whole global batch ('batch',
    one all-reduce), or no scaling ('none'). std_mode 'sample' divides the squared deviations by n - 1
    (TRL, torch.std), 'population' by n (1.41x larger advantages at G=2). A group whose rewards are all
    equal gets 0, not NaN."""
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}")
    r = rewards.double().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        std = r.std(dim=1, keepdim=True, unbiased=std_mode == "sample")
        return (centred / (std + ADV_EPS)).view(-1).float()
    if scale == "batch":
        return (centred / (batch_mean_std(r, std_mode)[1] + ADV_EPS)).view(-1).float()
    if scale == "none":
        return centred.view(-1).float()
    raise ValueError(f"unknown scale_rewards {scale!r}")


def rloo_advantages(rewards: torch.Tensor, group_size: int, scale: str, std_mode: str = "sample") -> torch.Tensor:
    """r minus the mean of the other G - 1 rewards of its group (G / (G - 1) times r minus the group's mean);
    'none' leaves it so (TRL's RLOOTrainer by default), 'batch' centres and divides it by the spread of the whole
    global batch's advantages (TRL's normalize_advantages), 'group' divides it by the std of its group's rewards."""
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}")
    if group_size < 2:
        raise ValueError("RLOO's baseline needs --group_size 2 or more")
    r = rewards.double().view(-1, group_size)
    loo = r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    if scale == "group":
        return (loo / (r.std(dim=1, keepdim=True, unbiased=std_mode == "sample") + ADV_EPS)).view(-1).float()
    if scale == "batch":
        mean, std = batch_mean_std(loo, std_mode)
        return ((loo - mean) / (std + ADV_EPS)).view(-1).float()
    if scale == "none":
        return loo.view(-1).float()
    raise ValueError(f"unknown scale_rewards {scale!r}")


def advantages(estimator: str, rewards: torch.Tensor, group_size: int, scale: str, std_mode: str = "sample"
               ) -> torch.Tensor:
    """The advantages --advantage names (ADVANTAGES)."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size, scale, std_mode)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size, scale, std_mode)
    raise ValueError(f"unknown advantage {estimator!r}")
