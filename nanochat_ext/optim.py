"""AdamW over the trainable parameters and the learning-rate schedule both trainers use."""
from __future__ import annotations

import math

import torch


def make_adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
               device: torch.device) -> torch.optim.AdamW:
    """Fused AdamW on CUDA (one kernel for all params); the default implementation on CPU."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=device.type == "cuda")


def lr_multiplier(step: int, max_steps: int, warmup_steps: int, final_frac: float = 0.1) -> float:
    """Linear warmup to 1, then cosine decay to `final_frac` at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
