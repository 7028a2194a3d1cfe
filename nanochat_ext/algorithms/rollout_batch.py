"""GRPO's batch: a step's completions as sequences (training/logprobs.py's Sequences) with what the step's stages add
to them, each field written by one stage and read by those after it: the prompts' density weights and the engine's
log-probs (the rollout), the reference's and the teacher's log-probs, the advantages, pi_old's log-probs (the first
of --num_iterations updates)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanochat_ext.training.logprobs import Sequences, per


@dataclass(slots=True, eq=False)
class RolloutBatch(Sequences):
    """A GRPO step's completions, prompt-major (prompt i owns completions i*G..i*G+G-1). Per completion: weights
    (its prompt's density weight). Per token, (completions, tokens): engine_logp (the log-prob the rollout engine
    sampled each token with), ref_logp (the frozen reference's; None without one), teacher_logp (--advantage
    distill's teacher), old_logp (pi_old, kept by the first update for the later ones). advantages: one per
    completion (n,), or per token (n, T) for REINFORCE++ and distillation."""
    weights: torch.Tensor | None = per("completion")
    engine_logp: torch.Tensor | None = per("token")
    ref_logp: torch.Tensor | None = per("token")
    teacher_logp: torch.Tensor | None = per("token")
    old_logp: torch.Tensor | None = per("token")
    advantages: torch.Tensor | None = per("token")
