"""AdamW over the trainable parameters, the learning-rate schedule and the guarded optimizer step the
trainers share."""
from __future__ import annotations

import math

import torch

from nanochat_ext.guard import StepGuard


def make_adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
               device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW (one pass over all params) on CUDA and CPU; torch's default elsewhere. On CPU the fused
    step of the bench's 1.5M-parameter Llama takes 0.4 ms, the default (foreach) 2.9 ms."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=device.type in ("cuda", "cpu"))


def lr_multiplier(step: int, max_steps: int, warmup_steps: int, final_frac: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to `final_frac` at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
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
