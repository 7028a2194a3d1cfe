"""GRPO's math: group-relative advantages and the clipped-surrogate + KL loss with aggregation normalised by
global counts (completion log-probs and the frozen reference: logprobs.py; rollouts and dynamic sampling: rollouts.py).

A rollout batch on one rank is `n` prompts x G samples, prompt-major (prompt i owns rows i*G..i*G+G-1);
a group never spans ranks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat_ext.ddp_common import all_reduce_sum
from nanochat_ext.training.logprobs import accumulate_backward

LOSS_AGGS = ("token", "sequence", "dr_grpo")
# TRL's --loss_type names for the same aggregations. bnpo divides each micro-batch by its own token count
# in TRL; here by the global batch's (as TRL's dapo): the same when a step is one micro-batch on one rank.
TRL_LOSS_TYPES = {"dapo": "token", "bnpo": "token", "grpo": "sequence", "dr_grpo": "dr_grpo"}
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
ADV_EPS = 1e-4


# ---- advantages ---------------------------------------------------------------------------------
STD_MODES = ("sample", "population")


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
        stats = all_reduce_sum(torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel()), dtype=r.dtype)]))
        n = stats[2]
        mean = stats[0] / n
        var = (stats[1] / n - mean * mean).clamp(min=0)
        if std_mode == "sample":
            var = var * n / (n - 1).clamp(min=1)
        return (centred / (var.sqrt() + ADV_EPS)).view(-1).float()
    if scale == "none":
        return centred.view(-1).float()
    raise ValueError(f"unknown scale_rewards {scale!r}")


# ---- loss ---------------------------------------------------------------------------------------
@dataclass
class LossConfig:
    loss_agg: str = "token"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: same as clip_eps
    beta: float = 0.0
    max_new_tokens: int = 64  # dr_grpo's constant normaliser
    importance_level: str = "token"  # sequence: GSPO's one ratio per completion


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


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, weights: torch.Tensor, cfg: LossConfig, normaliser: float):
    """Clipped surrogate + beta * KL(k3) per token, aggregated as cfg.loss_agg and divided by the
    global normaliser. Returns (loss, stats) with stats = [kl sum, clipped tokens, tokens, pg objective] on this
    rank, the last -sum(A logp) / normaliser aggregated as the loss (chat_rl's printed loss, normalised as ours).

    importance_level 'token': a ratio per token, pi(y_t) / pi_old(y_t) (GRPO). 'sequence' (GSPO): one
    ratio per completion, the geometric mean of its token ratios exp(mean_t log(pi / pi_old)), clipped
    as a whole, so a completion's tokens are all kept or all clipped."""
    log_ratio = logp - old_logp
    if cfg.importance_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    elif cfg.importance_level != "token":
        raise ValueError(f"unknown importance_level {cfg.importance_level!r}")
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + high) * adv)
    per_token = -surrogate
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


LOSS_STATS = ("loss", "kl", "clipped", "loss_tokens", "pg_objective", "entropy")  # policy_backward's, in order


def policy_backward(model: nn.Module, batch: dict[str, torch.Tensor], micro: int, cfg: LossConfig,
                    device: torch.device, autocast: contextlib.AbstractContextManager,
                    keep_old: bool = False) -> torch.Tensor:
    """One GRPO optimizer step's forward + backward on this rank, normalised over the global batch
    (denominator summed before any backward). Returns [loss, kl sum, clipped tokens, tokens, pg objective, entropy
    sum] (LOSS_STATS).
    pi_old is batch["old_logp"] where the batch has it, else this pass's own log-probs (the ratio is 1). keep_old
    (the first of --num_iterations updates): the batch keeps them as "old_logp" for its later updates. They are the
    training graph's log-probs, dropout included, not a separate no-grad pass's, which compiled (inductor fuses the
    two graphs apart) and in bf16 differ from them by rounding (up to 0.06 on CPU's bf16: a first ratio off 1)."""
    normaliser = all_reduce_sum(loss_normaliser(batch["mask"], batch["weights"], cfg)).item()
    normaliser = max(normaliser, 1e-8)  # every completion masked: the loss is 0, not NaN
    olds = [] if keep_old and "old_logp" not in batch else None

    def loss_fn(b, logp, entropy):
        old = b["old_logp"] if "old_logp" in b else logp.detach()
        if olds is not None:
            olds.append(old.float().cpu())
        loss, stats = grpo_loss(logp, old, b.get("ref_logp"), b["advantages"], b["mask"], b["weights"], cfg,
                                normaliser)
        return loss, torch.cat([stats, (entropy * b["mask"]).sum().double().cpu().view(1)])

    total = accumulate_backward(model, batch, micro, device, autocast, loss_fn)
    if olds is not None:
        batch["old_logp"] = torch.zeros(batch["target"].shape)
        row = 0
        for old in olds:  # micro-batches in order, each cut to its own longest completion
            batch["old_logp"][row:row + old.size(0), :old.size(1)] = old
            row += old.size(0)
    return total


