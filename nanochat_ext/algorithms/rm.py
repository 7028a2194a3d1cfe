"""The reward model's training: what trains of it, the weighted Bradley-Terry loss normalised over the global batch,
its step over micro-batches, its held-out evaluation, and the method the loop runs (the model itself and its files:
models/reward_model.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanochat_ext.config import NO, TrainerSpec, option
from nanochat_ext.data.batching import GlobalBatchLoader, TokenizedPair, by_length, collate_pairs, rank_chunks
from nanochat_ext.ddp_common import DistEnv, all_reduce_sum, get_world_size
from nanochat_ext.errors import InputError
from nanochat_ext.models.loader import RM_KIND
from nanochat_ext.models.lora import dropout_active
from nanochat_ext.models.reward_model import RewardModel
from nanochat_ext.runtime.oom import smaller_micro
from nanochat_ext.runtime.parallel import no_sync
from nanochat_ext.runtime.progress import Phase
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import StepMemory
from nanochat_ext.training.optim import ADAMW_ONLY
from nanochat_ext.training.setup import RewardModelTraining
from nanochat_ext.training.tracking import Tracker, WindowSums

# The RM's AdamW --lr where not given, by what trains (`bench/lr_sweep.sh rm` on SmolLM2-135M-Instruct, the sweep in
# docs/reward_models.md#learning-rate): the head alone learned best at 3e-3, which makes trained blocks diverge.
# LoRA's adapters train at the head's rate, as before the sweep (not swept).
RM_LRS = {"head": 3e-3, "blocks": 1e-4, "all": 1e-5}
# An --lr given at this many times the default for what trains gets a warning: the sweep's cliff lies below it.
RM_LR_WARN_FACTOR = 10

SPEC = TrainerSpec(
    name="rm", kind=RM_KIND, script="kat_train_rm", wrote="a reward model",
    model_flag=("--backbone", "the RM's backbone"),
    # lr: the head's alone, the default (--unfreeze_last 0); TRL's 1e-4 for a full fine-tune is far too small for it
    defaults={"batch_size": 32, "max_steps": 200, "num_epochs": NO, "optimizer": NO, "lr": RM_LRS["head"],
              "warmup_steps": 0, "lr_decay": NO, "log_every": 10, "eval_every": 50, "density": None, "val_ratio": 0.1,
              "max_len": None},
    words={"unit": "pairs", "micro_unit": "pairs", "model": "backbone", "steps": "optimizer steps",
           "max_steps": "%(default)s", "epochs": "", "seeds": " and head init", "responses": "responses",
           "at_most": ", at most 1024", "val_ratio": "", "stage_dir": "rm_checkpoints",
           "tag": "'density' with --density, else 'uniform'",
           "lr": f"by what trains: {RM_LRS['head']:g} for the head alone (and LoRA), {RM_LRS['blocks']:g} with "
                 f"--unfreeze_last N, {RM_LRS['all']:g} with all; measured on SmolLM2-135M-Instruct, "
                 "docs/reward_models.md#learning-rate", **ADAMW_ONLY})


@dataclass(frozen=True)
class RMConfig:
    """What trains of the reward model besides its head."""
    unfreeze_last: str = option("0", "train the last N backbone blocks too, or 'all' for a full fine-tune")

    def check(self) -> None:
        if self.unfreeze_last != "all" and not self.unfreeze_last.isdigit():
            raise InputError("--unfreeze_last must be a number of blocks or 'all'")

    def trains(self, lora: bool) -> str:
        """What the run trains besides the head, as RM_LRS names it: 'head', 'blocks', 'all' (LoRA: 'head')."""
        if lora or self.unfreeze_last == "0":
            return "head"
        return "all" if self.unfreeze_last == "all" else "blocks"

    def default_lr(self, lora: bool) -> float:
        return RM_LRS[self.trains(lora)]

    def lr_warning(self, lr: float, given: bool, lora: bool) -> str | None:
        """One line where a given --lr is far above the measured rate for what trains, else None."""
        trains = self.trains(lora)
        if not given or trains == "head" or lr < RM_LR_WARN_FACTOR * RM_LRS[trains]:
            return None
        blocks = f"the last {self.unfreeze_last} block" + ("" if self.unfreeze_last == "1" else "s")
        return (f"warning: --lr {lr:g} trains {'every block' if trains == 'all' else blocks} "
                f"at {lr / RM_LRS[trains]:.0f}x the default for them ({RM_LRS[trains]:g}); on SmolLM2 held-out "
                f"accuracy fell to chance or below at 10x (docs/reward_models.md#learning-rate)")

RM_STATS = ("loss", "correct", "margin", "pairs", "tokens", "computed")  # what rm_backward returns, in order


def effective_weights(weights: torch.Tensor, mode: str, cap: float | None) -> torch.Tensor:
    """Per-pair weights as the loss uses them: capped in 'mean'/'sum', all ones in 'none'."""
    if mode == "none":
        return torch.ones_like(weights)
    return weights.clamp(max=cap) if cap is not None else weights


def loss_normaliser(weights: torch.Tensor, mode: str, cap: float | None) -> torch.Tensor:
    """This rank's share of the denominator: sum of effective weights ('mean') or the pair count."""
    if mode == "mean":
        return effective_weights(weights, mode, cap).sum().double()
    return torch.tensor(float(weights.numel()), dtype=torch.float64)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, weights: torch.Tensor, mode: str,
                       cap: float | None, normaliser: float) -> torch.Tensor:
    """sum_i w_i * -log sigmoid(r_c - r_r) / normaliser, the normaliser summed over the global batch
    before any backward, so the loss of a global batch does not depend on how it was split."""
    w = effective_weights(weights.to(r_chosen.device), mode, cap)
    return (w * -F.logsigmoid(r_chosen - r_rejected)).sum() / normaliser


def rm_backward(model: torch.nn.Module, batches: list[dict], weight_mode: str, weight_cap: float | None,
                device: torch.device, autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """Forward + backward of one optimizer step's micro-batches on this rank (DDP syncs on the last).

    The loss denominator is summed over the whole global batch before any backward, and the loss is
    multiplied by the world size because DDP averages gradients over ranks: the accumulated gradient
    is that of the global-batch loss however the batch is split. Returns this rank's RM_STATS: loss,
    correct pairs, margin sum, pairs, tokens and computed tokens (see collate_pairs).
    """
    normaliser = all_reduce_sum(sum(loss_normaliser(b["weights"], weight_mode, weight_cap) for b in batches)).item()
    world = get_world_size()
    stats = torch.zeros(len(RM_STATS), dtype=torch.float64)
    for i, b in enumerate(batches):
        n = b["weights"].numel()
        with no_sync(model, skip_sync=i < len(batches) - 1), autocast:
            rewards = model(b["input_ids"].to(device), b["lengths"].to(device)).float()
            loss = bradley_terry_loss(rewards[:n], rewards[n:], b["weights"], weight_mode, weight_cap, normaliser)
            (loss * world).backward()
        margin = (rewards[:n] - rewards[n:]).detach().double().cpu()
        stats += torch.tensor([loss.item(), (margin > 0).sum().item(), margin.sum().item(), n,
                               b["tokens"], b["computed"]], dtype=torch.float64)
    return stats


@torch.no_grad()
def evaluate(model: RewardModel, pairs: list[TokenizedPair], env: DistEnv, batch: int, pad_id: int,
             autocast: contextlib.AbstractContextManager) -> dict:
    """Validation accuracy / margin / loss over all ranks: each rank scores every W-th pair. Every rank runs as
    many forwards as the rank with the most (one with fewer scores a pair it then leaves out): under --parallel fsdp
    each forward gathers the weights from every rank."""
    stats = torch.zeros(4, dtype=torch.float64)  # correct, margin, loss, n
    for chunk in rank_chunks(len(pairs), env.world_size, env.rank, batch):
        b = collate_pairs([pairs[i] for i in chunk or [0]], pad_id)
        n = b["weights"].numel()
        with autocast:
            r = model(b["input_ids"].to(env.device), b["lengths"].to(env.device)).float()
        if not chunk:
            continue
        margin = (r[:n] - r[n:]).double().cpu()
        stats += torch.tensor([(margin > 0).sum().item(), margin.sum().item(),
                               torch.nn.functional.softplus(-margin).sum().item(), n], dtype=torch.float64)
    stats = all_reduce_sum(stats)
    n = max(stats[3].item(), 1.0)
    return {"val/accuracy": stats[0].item() / n, "val/margin": stats[1].item() / n, "val/loss": stats[2].item() / n}


# The flags a resumed RM must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "seed", "unfreeze_last", "weight_mode", "weight_cap", "max_len", "long_pairs")


class RewardModelMethod:
    """The RM's method of the loop (training/loop.py): a step is the Bradley-Terry loss over its pairs in micro-batches,
    shortest rows together; the evaluation scores the held-out pairs."""
    name = SPEC.name
    headline = ("train/loss", "train/accuracy", "train/margin", "perf/pairs_per_s")  # its step line (--log_line short)

    def __init__(self, training: RewardModelTraining, weight_mode: str, weight_cap: float | None,
                 train: list[TokenizedPair], held_out: list[TokenizedPair], loader: GlobalBatchLoader,
                 estimate: StepMemory):
        self.training, self.weight_mode, self.weight_cap = training, weight_mode, weight_cap
        self.train, self.held_out, self.loader, self.estimate = train, held_out, loader, estimate
        self.plan = plan = loader.plan
        self.window = WindowSums([*RM_STATS, "steps"])  # this rank's sums since the last log
        self.evaluation = Phase(f"validation, {plan.device_batch_size} pairs at a time",
                                smaller_micro(plan.device_batch_size, plan.per_rank))

    def step(self, step: int, loop: Loop) -> None:
        t, plan, pad_id = self.training, self.plan, self.training.tok.pad_id
        micro_batches = by_length(self.loader.micro_batches(step), lambda i: self.train[i].row_length)
        batches = [collate_pairs([self.train[i] for i in mb], pad_id) for mb in micro_batches]
        with loop.progress.doing(f"a training micro-batch of {plan.device_batch_size} pairs",
                                 t.training_hints(plan.device_batch_size, plan.per_rank)), dropout_active(t.backbone):
            stats = rm_backward(t.ddp_model, batches, self.weight_mode, self.weight_cap, t.env.device, t.autocast)
        loop.update(stats[0].item())
        self.window.add(**dict(zip(RM_STATS, stats.tolist())))

    def metrics(self, s: dict[str, float], elapsed: float) -> dict[str, float]:
        """Every rank's loss is its share of the global one; steps count once per rank."""
        return {"train/loss": s["loss"] / (s["steps"] / self.training.env.world_size),
                "train/accuracy": s["correct"] / s["pairs"], "train/margin": s["margin"] / s["pairs"],
                "perf/pairs_per_s": s["pairs"] / elapsed, "perf/tokens_per_s": s["tokens"] / elapsed,
                "perf/computed_tokens_per_s": s["computed"] / elapsed}

    def evaluate(self, done: int, tracker: Tracker) -> dict[str, float]:
        t = self.training
        if not self.held_out:
            return {}
        return evaluate(t.model, self.held_out, t.env, self.plan.device_batch_size, t.tok.pad_id, t.autocast)

    def resume_state(self) -> dict:
        return {"device_batch_size": self.plan.device_batch_size}
