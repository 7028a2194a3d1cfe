"""The optimizers (AdamW over the trainable parameters; nanochat's MuonAdamW, with its groups and rates, for nanochat
policies), the learning-rate schedule and the guarded optimizer step the trainers share."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from nanochat_ext.config import FINITE_NON_NEGATIVE, FINITE_POSITIVE, NON_NEGATIVE, option
from nanochat_ext.errors import InputError
from nanochat_ext.models.gpt import GPT
from nanochat_ext.runtime.guard import StepGuard
from nanochat_ext.training.muon import MuonAdamW, orthogonalise_dtype

OPTIMIZERS = ("adamw", "muon")
LR_DECAYS = ("cosine", "linear")
MUON_LR = 0.05  # --lr under --optimizer muon where not given: nanochat chat_rl.py's --init-lr-frac

# Where a policy trainer's AdamW --lr falls off a cliff (its TrainerSpec.lr_cliff): the lowest rate above the best one
# at which a sweep on SmolLM2-135M-Instruct (bench/lr_sweep.sh, docs/hyperparameters.md#learning-rate) left the model
# no better than it started, and what it did there. A full fine-tune at or above it is one warning line, for a model of
# LR_CLIFF_PARAMS parameters or more: a safe rate falls as models grow, so the cliff holds at the swept size and above
# and says nothing of a far smaller model (the demo's). Every default --lr lies below its cliff. LoRA's adapters and
# Muon's fraction were not swept; the RM's rates follow what it trains (algorithms.rm.RMConfig.lr_warning).
LR_CLIFF_PARAMS = 100_000_000

# Words of the optimizer flags' shared help, by what a trainer has (TrainerSpec.words): SFT and the RM have neither
# --optimizer nor --lr_decay, DPO and GRPO both.
MUON_LR_HELP = ("; under --optimizer muon the fraction of nanochat's learning rates, its chat_rl.py --init-lr-frac "
                "(0.05)")
ADAMW_ONLY = {"muon_wd": "", "muon_lr": "", "schedule_flags": "--max_steps, --lr or --warmup_steps"}
SCHEDULED = {"muon_wd": " (the matrices' under --optimizer muon)", "muon_lr": MUON_LR_HELP,
             "schedule_flags": "--max_steps, --lr, --warmup_steps or --lr_decay"}


@dataclass(frozen=True)
class OptimConfig:
    """How the trained weights move: the optimizer, its learning-rate schedule, weight decay and clipping."""
    optimizer: str = option("adamw", "adamw; or muon, nanochat's own optimizer (MuonAdamW) for nanochat policies: its "
                            "Muon on the block matrices, AdamW on embeddings, LM head and scalars, each group at the "
                            "learning rate nanochat's chat_rl.py gives it; --weight_decay is then the matrices'",
                            choices=OPTIMIZERS)
    lr: float | None = option(None, "peak learning rate (default: {lr}){muon_lr}", check=FINITE_POSITIVE, type=float)
    warmup_steps: int = option(0, "linear warmup steps before the decay", check=NON_NEGATIVE, type=int)
    lr_decay: str = option("cosine", "after the warmup: cosine to 0.1x, or linear to 0 as nanochat's chat_rl",
                           choices=LR_DECAYS)
    weight_decay: float = option(0.0, "AdamW's decoupled weight decay{muon_wd}",
                                 check=FINITE_NON_NEGATIVE, type=float)
    grad_clip: float = option(1.0, "clip the global grad norm to this (0: off)", type=float,
                              check=(FINITE_NON_NEGATIVE[0], "a finite number >= 0 (0: off)"))

    def with_lr(self, adamw_lr: float) -> OptimConfig:
        """This config with --lr given where it was not: `adamw_lr` (the trainer's), or MUON_LR under muon."""
        if self.lr is not None:
            return self
        return dataclasses.replace(self, lr=MUON_LR if self.optimizer == "muon" else adamw_lr)


def make_adamw(params: list[torch.nn.Parameter] | list[dict], lr: float, weight_decay: float,
               device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW (one pass over all params) on CUDA and CPU; torch's default elsewhere. On CPU the fused
    step of the bench's 1.5M-parameter Llama takes 0.4 ms, the default (foreach) 2.9 ms."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=device.type in ("cuda", "cpu"))


# nanochat's chat_rl.py: setup_optimizer(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0)
# with its own scalar_lr=0.5, every group's lr then times --init-lr-frac (0.05, here --lr under muon).
NANOCHAT_LRS = {"unembedding": 0.004, "embedding": 0.2, "matrix": 0.02, "scalar": 0.5}


def nanochat_groups(model: nn.Module, lr_frac: float, matrix_weight_decay: float = 0.0) -> list[dict]:
    """The param groups of a nanochat GPT as nanochat's setup_optimizer makes them (karpathy/nanochat 92d63d4,
    gpt.py; its weight_decay argument is the matrices' one, chat_rl's --weight-decay), every lr times lr_frac:
    AdamW groups for the LM head, the token and value embeddings and the scalars, then one Muon group per shape of the
    blocks' matrices, shapes in sorted order. Groups a vintage has no parameters for are left out; every parameter is
    in exactly one group."""
    scale = (model.config.n_embd / 768) ** -0.5  # nanochat: AdamW lrs tuned at width 768, scaled by 1/sqrt(width)
    lr = {k: v * lr_frac for k, v in NANOCHAT_LRS.items()}
    get = lambda *names: [p for n in names if (p := getattr(model, n, None)) is not None]  # noqa: E731
    smear = [p for p in (getattr(getattr(model, "smear_gate", None), "weight", None),
                         getattr(model, "smear_lambda", None), getattr(model, "backout_lambda", None)) if p is not None]
    values = list(model.value_embeds.parameters()) if hasattr(model, "value_embeds") else []
    adamw = lambda params, lr, betas, wd: dict(kind="adamw", params=params, lr=lr, betas=betas, eps=1e-10,  # noqa: E731
                                               weight_decay=wd)
    groups = [adamw(list(model.lm_head.parameters()), lr["unembedding"] * scale, (0.8, 0.96), 0.01),
              adamw(list(model.transformer.wte.parameters()), lr["embedding"] * scale, (0.8, 0.995), 0.001),
              adamw(values, lr["embedding"] * scale * 0.5, (0.8, 0.995), 0.01),
              adamw(get("resid_lambdas"), lr["scalar"] * 0.01, (0.8, 0.95), 0.05),
              adamw(get("x0_lambdas"), lr["scalar"], (0.96, 0.95), 0.0),
              adamw(smear, 0.2 * lr_frac, (0.8, 0.95), 0.0)]  # nanochat's fixed 0.2
    matrices = list(model.transformer.h.parameters())
    for shape in sorted({p.shape for p in matrices}):  # a group's matrices step as one stack
        groups.append(dict(kind="muon", params=[p for p in matrices if p.shape == shape], lr=lr["matrix"],
                           momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=matrix_weight_decay))
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["initial_lr"] = g["lr"]
    placed = [id(p) for g in groups for p in g["params"]]
    if sorted(placed) != sorted(id(p) for p in model.parameters()):
        raise ValueError("a parameter of this GPT is outside nanochat's optimizer groups, or in two")
    return groups


def check_optimizer(kind: str, lora: bool, parallel: str) -> None:
    """Before anything loads: the combinations --optimizer muon cannot train, one line each."""
    if kind == "muon" and lora:
        raise InputError("--optimizer muon orthogonalises whole weight matrices; LoRA's adapters train with "
                         "--optimizer adamw")
    if kind == "muon" and parallel == "fsdp":
        raise InputError("--optimizer muon orthogonalises whole matrices, which --parallel fsdp splits over ranks: "
                         "train with --optimizer adamw under fsdp")


def check_muon_model(kind: str, model: nn.Module) -> None:
    """--optimizer muon trains a nanochat GPT only: one line for any other model, as soon as it is loaded."""
    if kind == "muon" and not isinstance(model, GPT):
        raise InputError(f"--optimizer muon is nanochat's recipe for nanochat GPT policies; a "
                         f"{type(model).__name__} trains with --optimizer adamw")


def lr_warning(trainer: str, lr_cliff: tuple[float, str] | None, optim: OptimConfig, parameters: int,
               lora: bool) -> str | None:
    """One line where a full fine-tune of a model of LR_CLIFF_PARAMS or more runs AdamW at or above the trainer's
    measured cliff (its TrainerSpec's), else None."""
    if lr_cliff is None or lora or optim.optimizer != "adamw" or parameters < LR_CLIFF_PARAMS:
        return None
    cliff, seen = lr_cliff
    if optim.lr < cliff:
        return None
    return (f"warning: --lr {optim.lr:g} is at or above {cliff:g}, where {trainer.upper()} on SmolLM2-135M-Instruct "
            f"fell off a cliff: {seen} (docs/hyperparameters.md#learning-rate)")


def make_optimizer(kind: str, model: nn.Module, params: list[nn.Parameter], lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.AdamW | MuonAdamW:
    """--optimizer: 'adamw' over params; 'muon' nanochat's MuonAdamW over a nanochat GPT (lr: the fraction of
    nanochat's learning rates, its --init-lr-frac; weight_decay: the matrices', its --weight-decay; the AdamW groups
    keep nanochat's own). Every group's base lr is kept as 'initial_lr' for the schedule."""
    if kind == "adamw":
        optimizer = make_adamw(params, lr, weight_decay, device)
        for g in optimizer.param_groups:
            g["initial_lr"] = lr
        return optimizer

    check_muon_model(kind, model)
    return MuonAdamW(nanochat_groups(model, lr, weight_decay), orthogonalise_dtype(device))



def lr_multiplier(step: int, max_steps: int, warmup_steps: int, final_frac: float = 0.1,
                  decay: str = "cosine") -> float:
    """Linear warmup to 1, then cosine decay to `final_frac` at max_steps; decay 'linear': 1 - step / max_steps
    after the warmup, nanochat chat_rl's schedule (to 0)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if decay == "linear":
        return 1.0 - min(1.0, progress)
    return final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def guarded_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad_clip: float,
                 guard: StepGuard, step: int, loss: float) -> float:
    """Clip the global grad norm (grad_clip 0: measure only), let the guard decide on every rank
    together whether the step is finite, take it or skip it, and clear the gradients. Returns the norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if guard.check(step, loss, grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
