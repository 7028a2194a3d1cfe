"""Direct preference optimisation on pairs: each pair's chosen and rejected log-probs under the policy (its prompt
computed once, a prefix tree of two branches), the reference's, the losses (DPO's sigmoid with cDPO label smoothing,
IPO, hinge, SimPO), weighted per pair and normalised over the global batch as the reward model's loss is, the
metrics TRL's DPOTrainer logs, and the method the loop runs. The formulas are TRL 1.16's (tests/test_dpo.py checks
them against its own code).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat_ext.algorithms.rm import effective_weights, loss_normaliser
from nanochat_ext.config import TrainerSpec, option
from nanochat_ext.data.batching import GlobalBatchLoader, TokenizedPair, by_length, rank_chunks
from nanochat_ext.ddp_common import all_reduce_sum
from nanochat_ext.errors import InputError
from nanochat_ext.models.lora import dropout_active
from nanochat_ext.runtime.oom import smaller_micro
from nanochat_ext.runtime.progress import Phase
from nanochat_ext.training.logprobs import Sequences, accumulate_backward, make_sequences, per, token_logprobs
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import StepMemory
from nanochat_ext.training.optim import SCHEDULED
from nanochat_ext.training.setup import PolicyTraining
from nanochat_ext.training.tracking import Tracker, WindowSums

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCE_FREE = ("simpo",)  # losses that never read a reference
# what dpo_backward returns, in order: the loss, then sums over this rank's pairs
DPO_STATS = ("loss", "pairs", "correct", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected", "tokens",
             "computed")

SPEC = TrainerSpec(
    name="dpo", kind="dpo_policy", script="kat_train_dpo", wrote="a DPO policy",
    model_flag=("--policy", "the model to train"),
    # TRL 1.16's DPOTrainer lr
    defaults={"batch_size": 32, "max_steps": None, "num_epochs": None, "optimizer": "adamw", "lr": 1e-6,
              "warmup_steps": 0, "lr_decay": "cosine", "log_every": 10, "eval_every": 50, "density": None,
              "val_ratio": 0.1, "max_len": None},
    words={"unit": "pairs", "micro_unit": "pairs", "model": "policy", "steps": "optimizer steps",
           "max_steps": "--num_epochs's, else 100", "epochs": "", "seeds": "", "responses": "responses",
           "at_most": ", at most 1024", "val_ratio": "", "stage_dir": "dpo_checkpoints",
           "tag": "'density' with --density, else 'uniform'", "lr": "1e-6, TRL's", **SCHEDULED},
    lr_cliff=(3e-4, "held-out greedy accuracy fell to 0.010 from the model's 0.062 in 16 steps, where 1e-5 reached "
                    "0.323"))


@dataclass(frozen=True)
class DPOConfig:
    """DPO's loss and its reference (TRL's DPOConfig names)."""
    loss_type: str = option("sigmoid", "sigmoid: DPO; ipo: IPO (log-ratios averaged per token, as TRL); hinge: SLiC's; "
                            "simpo: SimPO (average log-probs, no reference)", choices=DPO_LOSSES)
    beta: float = option(0.1, "the KL strength (DPO's beta; IPO's tau; SimPO's reward scale)", type=float,
                         check=(lambda v: 0 < v < float("inf"), "a finite number > 0 (the loss divides by it or "
                                                                  "scales by it)"))
    label_smoothing: float = option(0.0, "cDPO: the share of labels taken to be flipped, in [0, 0.5) (sigmoid and "
                                    "simpo)", type=float,
                                    check=(lambda v: 0 <= v < 0.5, "in [0, 0.5): the share of labels taken to be "
                                                                   "flipped"))
    simpo_gamma: float = option(0.5, "SimPO's target reward margin", type=float,
                                check=(lambda v: 0 <= v < float("inf"), "a finite number >= 0"))
    precompute_ref_logps: bool = option(False, "the reference's log-probs of every pair once before training, then the "
                                        "reference is freed (worth it for a run of one epoch or more); default: "
                                        "computed with each step's pairs, as TRL does", action="store_true")
    weight_mode: str = "mean"  # the pairs' (PairsConfig)
    weight_cap: float | None = None

    @property
    def uses_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    def check(self, reference: str | None) -> None:
        """The combinations no loss can take, one line each (`reference`: --reference as given)."""
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            raise InputError(f"--label_smoothing applies to --loss_type sigmoid and simpo, not {self.loss_type}")
        if self.loss_type == "simpo" and (reference or self.precompute_ref_logps):
            flag = "--reference" if reference else "--precompute_ref_logps"
            raise InputError(f"{flag}: --loss_type simpo uses no reference; leave {flag} out")


def smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    """-log sigmoid(z), with label smoothing eps: the loss of a label that is flipped with probability eps (cDPO)."""
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps


def dpo_losses(logp: torch.Tensor, ref: torch.Tensor | None, n_tokens: torch.Tensor,
               cfg: DPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses and (P, 2) implicit rewards from (P, 2) sequence log-probs [chosen, rejected] of the policy and
    the reference (None for SimPO), and each response's token count.
    - sigmoid: -log sigmoid(beta * delta), delta the chosen log-ratio minus the rejected one; label smoothing as cDPO
      (TRL 1.16 applies it in its CPO trainer's sigmoid and its robust and aot losses, not in DPOTrainer's sigmoid,
      which is this loss at smoothing 0).
    - ipo: (delta_avg - 1 / (2 beta))^2, each log-ratio averaged over its response's tokens, as TRL does.
    - hinge: relu(1 - beta * delta).
    - simpo: -log sigmoid(beta * (avg logp chosen - avg logp rejected) - gamma), no reference (TRL's CPO trainer
      with loss_type simpo and cpo_alpha 0), smoothed as sigmoid.
    Rewards: beta times the log-ratio (DPO, IPO, hinge) or the average log-prob (SimPO), as TRL logs them."""
    if cfg.loss_type == "simpo":
        avg = logp / n_tokens.clamp(min=1)
        z = cfg.beta * (avg[:, 0] - avg[:, 1]) - cfg.simpo_gamma
        return smoothed_sigmoid(z, cfg.label_smoothing), cfg.beta * avg.detach()
    ratio = logp - ref
    delta = ratio[:, 0] - ratio[:, 1]
    if cfg.loss_type == "sigmoid":
        losses = smoothed_sigmoid(cfg.beta * delta, cfg.label_smoothing)
    elif cfg.loss_type == "ipo":
        avg = ratio / n_tokens.clamp(min=1)
        losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * cfg.beta)) ** 2
    elif cfg.loss_type == "hinge":
        losses = torch.relu(1 - cfg.beta * delta)
    else:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}")
    return losses, cfg.beta * ratio.detach()


@dataclass(slots=True, eq=False)
class PairBatch(Sequences):
    """Pairs as completions (pair_sequences), and per completion: its pair's weight, half its pair's tokens and
    computed tokens (as collate_pairs counts them), and its summed reference log-prob (ref; None until computed)."""
    weights: torch.Tensor | None = per("completion")
    tokens: torch.Tensor | None = per("completion")
    computed: torch.Tensor | None = per("completion")
    ref: torch.Tensor | None = per("completion")


def pair_sequences(pairs: list[TokenizedPair], pad_id: int) -> PairBatch:
    """The pairs as completion batches (make_sequences): completion 2i is pair i's chosen response, 2i + 1 its
    rejected one, both after the pair's prompt; what they share (the prompt at least) is one prefix-tree row.
    Per completion: its pair's weight, half its pair's tokens and computed tokens (as collate_pairs counts them),
    and its reference log-prob where the pairs carry them (--precompute_ref_logps)."""
    prompts = [p.chosen[:p.prompt_len] for p in pairs]
    completions = [r for p in pairs for r in (p.chosen[p.prompt_len:], p.rejected[p.prompt_len:])]
    sequences = make_sequences(prompts, completions, 2, pad_id, share_prompt=True)
    return PairBatch.of(
        sequences, weights=torch.tensor([p.weight for p in pairs], dtype=torch.float32).repeat_interleave(2),
        tokens=torch.tensor([len(p.chosen) + len(p.rejected) for p in pairs]).repeat_interleave(2) / 2,
        computed=sequences.branches.sum(1).repeat_interleave(2) / 2,
        ref=torch.tensor([r for p in pairs for r in p.ref], dtype=torch.float32) if pairs[0].ref is not None else None)


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, 2) summed log-probs and token counts of completions [chosen, rejected] of P pairs."""
    return (logp * mask).sum(1).view(-1, 2), mask.sum(1).view(-1, 2)


def pair_stats(rewards: torch.Tensor, logps: torch.Tensor, b: PairBatch) -> torch.Tensor:
    """DPO_STATS after the loss: pairs, correct, rewards and log-probs summed, tokens and computed tokens."""
    r, s = rewards.detach().double().cpu(), logps.detach().double().cpu()
    return torch.tensor([r.size(0), (r[:, 0] > r[:, 1]).sum().item(), r[:, 0].sum().item(), r[:, 1].sum().item(),
                         s[:, 0].sum().item(), s[:, 1].sum().item(), b.tokens.sum().item(),
                         b.computed.sum().item()], dtype=torch.float64)


def dpo_backward(model: nn.Module, batch: PairBatch, micro: int, cfg: DPOConfig, device: torch.device,
                 autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """One optimizer step's forward + backward on this rank's pairs (pair_sequences, with ref unless SimPO), in
    micro-batches of `micro` completions (whole pairs). The loss is sum_i w_i * loss_i over the global batch
    divided by its normaliser (the reward model's weight modes), summed over ranks before any backward, so it does
    not depend on how the batch is split. Returns this rank's DPO_STATS."""
    weights = batch.weights[::2]
    normaliser = max(all_reduce_sum(loss_normaliser(weights, cfg.weight_mode, cfg.weight_cap)).item(), 1e-8)

    def loss_fn(b: PairBatch, logp, entropy):
        logps, n_tokens = sequence_logps(logp, b.mask)
        losses, rewards = dpo_losses(logps, b.ref.view(-1, 2) if cfg.uses_reference else None, n_tokens, cfg)
        w = effective_weights(b.weights[::2], cfg.weight_mode, cfg.weight_cap)
        return (w * losses).sum() / normaliser, pair_stats(rewards, logps, b)

    return accumulate_backward(model, batch, micro, device, autocast, loss_fn)


@torch.no_grad()
def over_ranks(model: nn.Module, pairs: list[TokenizedPair], pad_id: int, pairs_per_forward: int, world: int,
               rank: int, device: torch.device, autocast: contextlib.AbstractContextManager,
               reference: nn.Module | None = None) -> Iterator[tuple[list[int], PairBatch, torch.Tensor]]:
    """Collective: yields (indices, batch, token log-probs) for this rank's share of `pairs` under `model`,
    without grad, the same number of forwards on every rank (a rank with fewer pairs runs a pair it then leaves
    out); with `reference`, each batch's ref too, where the pairs do not carry it, as many forwards alike."""
    for chunk in rank_chunks(len(pairs), world, rank, pairs_per_forward):
        batch = pair_sequences([pairs[i] for i in chunk or [0]], pad_id)
        logp = token_logprobs(model, batch, batch.n_completions, device, autocast)
        if reference is not None and batch.ref is None:
            batch.ref = reference_logps(reference, batch, batch.n_completions, device, autocast)
        if chunk:
            yield chunk, batch, logp


def precompute_reference(reference: nn.Module, pairs: list[TokenizedPair], pad_id: int, pairs_per_forward: int,
                         world: int, rank: int, device: torch.device,
                         autocast: contextlib.AbstractContextManager) -> None:
    """Collective: every pair's reference log-probs (chosen, rejected) into pair.ref, each rank computing its share."""
    out = torch.zeros(len(pairs), 2, dtype=torch.float64)
    for chunk, batch, logp in over_ranks(reference, pairs, pad_id, pairs_per_forward, world, rank, device, autocast):
        out[chunk] = sequence_logps(logp, batch.mask)[0].double()
    for p, ref in zip(pairs, all_reduce_sum(out).tolist()):
        p.ref = (ref[0], ref[1])


def reference_logps(reference: nn.Module, batch: PairBatch, micro: int, device: torch.device,
                    autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """Each completion's summed log-prob under the frozen reference, without grad: the batch's ref."""
    return (token_logprobs(reference, batch, micro, device, autocast) * batch.mask).sum(1)


def dpo_evaluate(model: nn.Module, reference: nn.Module | None, pairs: list[TokenizedPair], pad_id: int,
                 pairs_per_forward: int, cfg: DPOConfig, world: int, rank: int, device: torch.device,
                 autocast: contextlib.AbstractContextManager) -> dict[str, float]:
    """Collective: held-out pairs' loss and DPO metrics over all ranks (dpo_metrics, val/), each pair counted once:
    unweighted, where the training loss carries the density weights."""
    stats = torch.zeros(len(DPO_STATS), dtype=torch.float64)
    for _, batch, logp in over_ranks(model, pairs, pad_id, pairs_per_forward, world, rank, device, autocast,
                                     reference if cfg.uses_reference else None):
        logps, n_tokens = sequence_logps(logp, batch.mask)
        losses, rewards = dpo_losses(logps, batch.ref.view(-1, 2) if cfg.uses_reference else None, n_tokens, cfg)
        stats += torch.cat([losses.sum().double().cpu().view(1), pair_stats(rewards, logps, batch)])
    s = dict(zip(DPO_STATS, all_reduce_sum(stats).tolist()))
    return {"val/loss": s["loss"] / max(s["pairs"], 1.0), **dpo_metrics(s, "val/")}


def dpo_metrics(s: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Reduced DPO_STATS as TRL's DPOTrainer names them (rewards/..., logps/...), means over pairs."""
    n = max(s["pairs"], 1.0)
    return {f"{prefix}rewards/chosen": s["reward_chosen"] / n, f"{prefix}rewards/rejected": s["reward_rejected"] / n,
            f"{prefix}rewards/margins": (s["reward_chosen"] - s["reward_rejected"]) / n,
            f"{prefix}rewards/accuracies": s["correct"] / n,
            f"{prefix}logps/chosen": s["logp_chosen"] / n, f"{prefix}logps/rejected": s["logp_rejected"] / n}


# The flags a resumed run must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "seed", "loss_type", "beta", "label_smoothing", "simpo_gamma", "weight_mode",
                "weight_cap", "max_len", "long_pairs", "optimizer", "reference", "precompute_ref_logps")


class DPO:
    """The DPO method of the loop (training/loop.py): a step is the reference's log-probs of its pairs (unless
    precomputed: `reference` None) and the policy's forward and backward over them in micro-batches, shortest rows
    together; the evaluation scores the held-out pairs."""
    name = SPEC.name
    headline = ("train/loss", "rewards/accuracies", "rewards/margins",
                "perf/pairs_per_s")  # its step line (--log_line short)

    def __init__(self, training: PolicyTraining, cfg: DPOConfig, reference: nn.Module | None,
                 train: list[TokenizedPair], held_out: list[TokenizedPair], loader: GlobalBatchLoader,
                 estimate: StepMemory):
        self.training, self.cfg, self.reference, self.train, self.held_out = training, cfg, reference, train, held_out
        self.plan, self.loader, self.estimate = loader.plan, loader, estimate
        plan = loader.plan
        self.window = WindowSums([*DPO_STATS, "steps"])  # this rank's sums since the last log
        self.evaluation = Phase(f"validation, {plan.device_batch_size} pairs at a time",
                                smaller_micro(plan.device_batch_size, plan.per_rank))

    def step(self, step: int, loop: Loop) -> None:
        t, plan, env = self.training, self.plan, self.training.env
        mine = [i for mb in by_length(self.loader.micro_batches(step), lambda i: self.train[i].row_length) for i in mb]
        batch = pair_sequences([self.train[i] for i in mine], t.tok.pad_id)
        micro = 2 * plan.device_batch_size  # sequences: a pair's two responses
        if self.reference is not None:
            with loop.progress.doing(f"the reference's log-probs, {plan.device_batch_size} pairs at a time",
                                     smaller_micro(plan.device_batch_size, plan.per_rank)):
                batch.ref = reference_logps(self.reference, batch, micro, env.device, t.autocast)
        with loop.progress.doing(f"a training micro-batch of {plan.device_batch_size} pairs",
                                 t.training_hints(plan.device_batch_size, plan.per_rank)), dropout_active(t.policy):
            stats = dpo_backward(t.ddp_model, batch, micro, self.cfg, env.device, t.autocast)
        loop.update(stats[0].item())
        self.window.add(**dict(zip(DPO_STATS, stats.tolist())))

    def metrics(self, s: dict[str, float], elapsed: float) -> dict[str, float]:
        """Every rank's loss is its share of the global one; steps count once per rank."""
        return {"train/loss": s["loss"] / (s["steps"] / self.training.env.world_size), **dpo_metrics(s),
                "perf/pairs_per_s": s["pairs"] / elapsed, "perf/tokens_per_s": s["tokens"] / elapsed,
                "perf/computed_tokens_per_s": s["computed"] / elapsed}

    def evaluate(self, done: int, tracker: Tracker) -> dict[str, float]:
        t, env = self.training, self.training.env
        if not self.held_out:
            return {}
        return dpo_evaluate(t.model, self.reference, self.held_out, t.tok.pad_id, self.plan.device_batch_size,
                            self.cfg, env.world_size, env.rank, env.device, t.autocast)

    def resume_state(self) -> dict:
        return {"device_batch_size": self.plan.device_batch_size}
