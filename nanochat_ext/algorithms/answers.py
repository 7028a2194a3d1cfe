"""A checkpoint's answers to prompts, as its training asked them: each prompt rendered as the run rendered its
rollouts' (the chat template with its generation prompt, the tools the run had: its checkpoint records them), decoded
by the rollout engine in batches, each prompt's samples from its own seed; and their mean rewards, as the run's
held-out evaluation computes them. nanochat_ext.api's generate and evaluate, in the caller's process on its device
(no process group: under torchrun each rank answers every prompt).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.rewards import Rewards
from nanochat_ext.data.batching import encode_prompts
from nanochat_ext.data.rows import InMemoryRows, PromptRow, load_prompts
from nanochat_ext.ddp_common import detect_launcher, pick_device
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig, sample_seed
from nanochat_ext.errors import InputError
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.runtime import process_state
from nanochat_ext.runtime.checkpoint import find_checkpoint, read_json, resolve_model_path
from nanochat_ext.runtime.precision import compute_dtype, precision

ANSWERS_DRAW = -3  # the sample_seed draw of answers (a run's steps are 0.., its evaluation -1, kat_eval's -2)
MAX_NEW_TOKENS = 256  # where neither the call nor the checkpoint's run says (less where the model's context ends)


@dataclass(frozen=True)
class AnswerOptions:
    """How generate() and evaluate() answer (api.generate's keywords)."""
    n: int = 1  # replies to each prompt
    max_new_tokens: int | None = None  # None: the checkpoint's run's --max_new_tokens, else MAX_NEW_TOKENS or the
    # room the model's context leaves the longest prompt, whichever is less
    temperature: float = 0.0  # 0: greedy (a run's eval/*_greedy); n > 1 needs a temperature
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0  # prompt i samples from a seed of (seed, i) alone
    tokenizer: str | None = None  # None: the checkpoint's own
    device: str = "auto"  # auto: this process's GPU where there is one, else the CPU
    dtype: str = "auto"  # the compute dtype, as --dtype (auto: bf16 on CUDA)
    tools: str | AgentConfig | None = None  # None: the tools the checkpoint's run had; "none", "calculator", ...
    batch_size: int = 32  # prompts a generate call

    def check(self) -> None:
        """One line for an option out of its range."""
        for name, ok in [("n", self.n >= 1), ("max_new_tokens", (self.max_new_tokens or 1) >= 1),
                         ("temperature", self.temperature >= 0), ("top_k", self.top_k >= 0),
                         ("top_p", 0 < self.top_p <= 1), ("batch_size", self.batch_size >= 1)]:
            if not ok:
                raise InputError(f"{name} {getattr(self, name)!r} is out of range")
        if self.n > 1 and self.temperature == 0:
            raise InputError(f"n {self.n} at temperature 0 gives {self.n} equal replies: give a temperature")


def prompt_rows(prompts: Any) -> list[PromptRow]:
    """Prompts as the trainers read them: a file's path, or given in Python: a list (or a datasets.Dataset) of rows
    ({"prompt": str | messages, "answer"?, ...}), of strings (one user turn each) or of message lists."""
    if isinstance(prompts, (str, os.PathLike)):
        if not Path(prompts).exists():
            raise InputError(f"prompts: {str(prompts)[:60]!r} is not a file; to ask one prompt, give a list: "
                             f"prompts=[{str(prompts)[:60]!r}]")
        return load_prompts(prompts)
    if not isinstance(prompts, Iterable) or isinstance(prompts, Mapping):
        raise InputError(f"prompts: give a list of prompts, rows or message lists, or a file's path; got "
                         f"{type(prompts).__name__}")
    rows = list(prompts)
    return load_prompts(InMemoryRows(rows, f"prompts: a {type(prompts).__name__} of {len(rows)} rows", prompts=True))


def replies(checkpoint: str | os.PathLike, rows: list[PromptRow], o: AnswerOptions) -> list[list[str]]:
    """o.n replies to each row's prompt (what reward functions read: the last assistant turn, without its stop),
    o.batch_size prompts a generate call: the model loaded on o.device, frozen in the compute dtype, with the tools
    its run recorded (o.tools: others); the process's generators and settings as they were after."""
    o.check()
    flags = recorded_flags(checkpoint)
    tools = AgentConfig(tools=o.tools) if isinstance(o.tools, str) else o.tools or recorded_tools(flags)
    asked = o.max_new_tokens or flags.get("max_new_tokens")  # None: MAX_NEW_TOKENS, or less where the context ends
    with process_state.kept():
        device = pick_device(o.device, detect_launcher()[2])
        dtype = compute_dtype(o.dtype, device)
        policy = load_backbone(checkpoint, device, frozen=dtype)
        tok = load_tokenizer_for(policy, o.tokenizer)
        agent = Agent(tools, tok)
        engine, autocast = Engine(policy, agent=agent), precision(dtype, device)
        ids = encode_prompts(rows, agent.render_prompt, policy.max_seq_len, asked or 1, rows[0].path, "max_new_tokens")
        room = policy.max_seq_len - max(map(len, ids))  # what the model's context leaves the longest prompt
        cfg = SamplingConfig(asked or min(MAX_NEW_TOKENS, room), o.temperature, o.top_k, o.top_p)
        out: list[list[str]] = []
        for start in range(0, len(rows), o.batch_size):
            chunk = range(start, min(start + o.batch_size, len(rows)))
            with autocast, torch.no_grad():
                samples = engine.generate([ids[i] for i in chunk], o.n, cfg, tok.stop_ids, tok.pad_id,
                                          [torch.Generator().manual_seed(sample_seed(o.seed, ANSWERS_DRAW, i))
                                           for i in chunk], [rows[i].row for i in chunk])
            texts = samples.replies(tok)
            out += [texts[k * o.n:(k + 1) * o.n] for k in range(len(chunk))]
    return out


def recorded_flags(checkpoint: str | os.PathLike) -> dict:
    """The flags a trained checkpoint's run recorded in its meta ({} for a model dir no run of ours wrote)."""
    found = find_checkpoint(resolve_model_path(checkpoint))
    return (read_json(found[1]).get("args") or {}) if found else {}


def recorded_tools(flags: dict) -> AgentConfig:
    """The tools and their format a run recorded (every trainer records them: SFT renders its data with them too),
    else the trainers' default (nanochat's calculator where the tokenizer has its python tokens)."""
    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    return AgentConfig(**{k: v for k, v in flags.items() if k in fields and k != "env"})


def mean_rewards(rows: list[PromptRow], answers: list[list[str]], reward_fns: list) -> dict[str, float]:
    """As a run's held-out evaluation logs them: each reward function's mean over every reply, `reward_<name>`, and
    `reward`, their sum (each weighed 1); a reply the machine could not score (errors.Unscored) counts 0, as there,
    and `unscored` says how many. A function's failure is one line naming it and the row."""
    rewards = Rewards(None, reward_fns, None)
    indices = [i for i, texts in enumerate(answers) for _ in texts]
    texts = [t for texts in answers for t in texts]
    values = torch.tensor([rewards.task_scores(rows, indices, texts, k) for k in range(len(rewards.fns))],
                          dtype=torch.float64)
    means = {f"reward_{name}": float(v) for (name, _), v in zip(rewards.fns, values.nan_to_num(0.0).mean(1))}
    return {"reward": sum(means.values()), **means, "unscored": int(torch.isnan(values).any(0).sum())}
