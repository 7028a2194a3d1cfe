"""The optimizers (AdamW over the trainable parameters; nanochat's Muon + AdamW split for nanochat policies), the
learning-rate schedule and the guarded optimizer step the trainers share."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from nanochat_ext.errors import InputError
from nanochat_ext.gpt import GPT
from nanochat_ext.guard import StepGuard

OPTIMIZERS = ("adamw", "muon")


def make_adamw(params: list[torch.nn.Parameter] | list[dict], lr: float, weight_decay: float,
               device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW (one pass over all params) on CUDA and CPU; torch's default elsewhere. On CPU the fused
    step of the bench's 1.5M-parameter Llama takes 0.4 ms, the default (foreach) 2.9 ms."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=device.type in ("cuda", "cpu"))


class MuonAdamW:
    """nanochat's optimizer split made of torch's own optimizers: torch.optim.Muon on the transformer blocks'
    matrices, torch.optim.AdamW on the embeddings, the LM head and the scalars, each group as nanochat's
    scripts/chat_rl.py sets it (nanochat_groups). One object with what the trainers use of an optimizer: its
    param_groups (both parts', the same dicts), step, zero_grad and a state dict holding both."""

    def __init__(self, adamw_groups: list[dict], muon_groups: list[dict], device: torch.device):
        self.adamw = make_adamw(adamw_groups, 0.0, 0.0, device)  # every group sets its own lr, betas, decay
        self.muon = torch.optim.Muon(muon_groups, adjust_lr_fn="original")  # lr x max(1, rows / cols) ** 0.5

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"adamw", "muon"}:
            raise InputError("the checkpoint's optimizer state is not --optimizer muon's")
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


# nanochat's chat_rl.py: setup_optimizer(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0)
# with its own scalar_lr=0.5, every group's lr then times --init-lr-frac (0.05, here --lr under muon).
NANOCHAT_LRS = {"unembedding": 0.004, "embedding": 0.2, "matrix": 0.02, "scalar": 0.5}


def nanochat_groups(model: nn.Module, lr_frac: float) -> tuple[list[dict], list[dict]]:
    """(AdamW groups, Muon groups) of a nanochat GPT as nanochat's setup_optimizer makes them (karpathy/nanochat
    92d63d4, gpt.py), every lr times lr_frac. Groups a vintage has no parameters for are left out; every
    parameter is in exactly one group."""
    scale = (model.config.n_embd / 768) ** -0.5  # nanochat: AdamW lrs tuned at width 768, scaled by 1/sqrt(width)
    lr = {k: v * lr_frac for k, v in NANOCHAT_LRS.items()}
    get = lambda *names: [p for n in names if (p := getattr(model, n, None)) is not None]  # noqa: E731
    smear = [p for p in (getattr(getattr(model, "smear_gate", None), "weight", None),
                         getattr(model, "smear_lambda", None), getattr(model, "backout_lambda", None)) if p is not None]
    values = list(model.value_embeds.parameters()) if hasattr(model, "value_embeds") else []
    adamw = [dict(params=list(model.lm_head.parameters()), lr=lr["unembedding"] * scale, betas=(0.8, 0.96),
                  eps=1e-10, weight_decay=0.01),
             dict(params=list(model.transformer.wte.parameters()), lr=lr["embedding"] * scale, betas=(0.8, 0.995),
                  eps=1e-10, weight_decay=0.001),
             dict(params=values, lr=lr["embedding"] * scale * 0.5, betas=(0.8, 0.995), eps=1e-10, weight_decay=0.01),
             dict(params=get("resid_lambdas"), lr=lr["scalar"] * 0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05),
             dict(params=get("x0_lambdas"), lr=lr["scalar"], betas=(0.96, 0.95), eps=1e-10, weight_decay=0.0),
             dict(params=smear, lr=0.2 * lr_frac, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)]  # nanochat's 0.2
    muon = [dict(params=list(model.transformer.h.parameters()), lr=lr["matrix"], momentum=0.95, ns_steps=5,
                 weight_decay=0.0)]
    groups = [g for g in adamw + muon if g["params"]]
    for g in groups:
        g["initial_lr"] = g["lr"]
    placed = [id(p) for g in groups for p in g["params"]]
    if sorted(placed) != sorted(id(p) for p in model.parameters()):
        raise ValueError("a parameter of this GPT is outside nanochat's optimizer groups, or in two")
    return [g for g in adamw if g["params"]], [g for g in muon if g["params"]]


def make_optimizer(kind: str, model: nn.Module, params: list[nn.Parameter], lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.AdamW | MuonAdamW:
    """--optimizer: 'adamw' over params; 'muon' nanochat's split over a nanochat GPT (lr: the fraction of
    nanochat's learning rates, its --init-lr-frac; weight decay per group as nanochat sets it, so --weight_decay is
    refused). Every group's base lr is kept as 'initial_lr' for the schedule."""
    if kind == "adamw":
        optimizer = make_adamw(params, lr, weight_decay, device)
        for g in optimizer.param_groups:
            g["initial_lr"] = lr
        return optimizer

    if not isinstance(model, GPT):
        raise InputError(f"--optimizer muon is nanochat's recipe for nanochat GPT policies; a "
                         f"{type(model).__name__} trains with --optimizer adamw")
    if weight_decay:
        raise InputError("--weight_decay is for --optimizer adamw; muon takes nanochat's per-group weight decay")
    return MuonAdamW(*nanochat_groups(model, lr), device)


LR_DECAYS = ("cosine", "linear")


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
