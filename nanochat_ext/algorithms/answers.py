"""A checkpoint's answers to prompts, as its training asked them: each prompt rendered as the run rendered its
rollouts' (the chat template with its generation prompt, the tools the run had: its checkpoint records them), decoded
by the rollout engine in batches, each prompt's samples from its own seed; and their mean rewards. nanochat_ext.api's
generate and evaluate, in the caller's process on its device (no process group: under torchrun each rank answers
every prompt).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from nanochat_ext.algorithms.rewards import Rewards, check_references, load_reward_fn
from nanochat_ext.data.batching import encode_prompts
from nanochat_ext.data.rows import InMemoryRows, PromptRow, load_prompts
from nanochat_ext.ddp_common import detect_launcher, pick_device
from nanochat_ext.errors import InputError
from nanochat_ext.generation.agent import Agent, AgentConfig
from nanochat_ext.generation.engine import Engine
from nanochat_ext.generation.sampling import SamplingConfig, sample_seed
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.runtime.checkpoint import find_checkpoint, read_json, resolve_model_path
from nanochat_ext.runtime.precision import compute_dtype, precision
from nanochat_ext.tokenizer import TokenizerWrapper

ANSWERS_DRAW = -3  # the sample_seed draw of answers (a run's steps are 0.., its evaluation -1, kat_eval's -2)


@dataclass
class Answerer:
    """A checkpoint loaded to answer: its model and engine, tokenizer, the tools its run had, the compute dtype."""
    policy: Backbone
    tok: TokenizerWrapper
    agent: Agent
    engine: Engine
    autocast: ContextManager


def load_answerer(checkpoint: str | os.PathLike, tokenizer: str | None, device: str, dtype: str,
                  tools: AgentConfig | None) -> Answerer:
    """The checkpoint on `device` (auto: this rank's GPU, else the CPU), frozen in the compute dtype, with the tools
    its run recorded (tools: given ones instead; a checkpoint that records none, an SFT's or a model dir, gets the
    trainers' default: nanochat's calculator where the tokenizer has its python tokens)."""
    dev = pick_device(device, detect_launcher()[2])
    compute = compute_dtype(dtype, dev)
    policy = load_backbone(checkpoint, dev, frozen=compute)
    tok = load_tokenizer_for(policy, tokenizer)
    agent = Agent(tools if tools is not None else recorded_tools(checkpoint), tok)
    return Answerer(policy, tok, agent, Engine(policy, agent=agent), precision(compute, dev))


def recorded_tools(checkpoint: str | os.PathLike) -> AgentConfig:
    """The tools and their format a trained checkpoint's run had (its meta's flags), else the default."""
    found = find_checkpoint(resolve_model_path(checkpoint))
    flags = (read_json(found[1]).get("args") or {}) if found else {}
    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    return AgentConfig(**{k: v for k, v in flags.items() if k in fields and k != "env"})


def prompt_rows(prompts: Any) -> list[PromptRow]:
    """Prompts as the trainers read them: a file's path, or given in Python: a list (or a datasets.Dataset) of rows
    ({"prompt": str | messages, "answer"?, ...}), of strings (one user turn each) or of message lists."""
    if isinstance(prompts, (str, os.PathLike)):
        if not Path(prompts).exists():
            raise InputError("prompts: file not found", path=str(prompts))
        return load_prompts(prompts)
    if not isinstance(prompts, Iterable) or isinstance(prompts, Mapping):
        raise InputError(f"prompts: give a list of prompts, rows or message lists, or a file's path; got "
                         f"{type(prompts).__name__}")
    rows = [p if isinstance(p, Mapping) else {"prompt": p} for p in prompts]
    return load_prompts(InMemoryRows(rows, f"prompts: a {type(prompts).__name__} of {len(rows)} rows"))


def answer(answerer: Answerer, rows: list[PromptRow], n: int, cfg: SamplingConfig, seed: int,
           batch_size: int) -> list[list[str]]:
    """n replies to each row's prompt (what reward functions read: the last assistant turn), batch_size prompts a
    generate call; prompt i samples from sample_seed(seed, ANSWERS_DRAW, i), whatever batch it lands in."""
    a = answerer
    ids = encode_prompts(rows, a.agent.render_prompt, a.policy.max_seq_len, cfg.max_new_tokens, str(rows[0].path),
                         "max_new_tokens")
    replies: list[list[str]] = []
    for start in range(0, len(rows), batch_size):
        chunk = range(start, min(start + batch_size, len(rows)))
        with a.autocast, torch.no_grad():
            samples = a.engine.generate([ids[i] for i in chunk], n, cfg, a.tok.stop_ids, a.tok.pad_id,
                                        [torch.Generator().manual_seed(sample_seed(seed, ANSWERS_DRAW, i))
                                         for i in chunk], [rows[i].row for i in chunk])
        texts = samples.replies(a.tok)
        replies += [texts[k * n:(k + 1) * n] for k in range(len(chunk))]
    return replies


def mean_rewards(rows: list[PromptRow], replies: list[list[str]], reward_fns: list) -> dict[str, float]:
    """Each reward function's mean over every reply, by its name (as train/reward_<name> logs it), and `reward`:
    their sum, as a run weighs them by default. A function's failure is one line naming it and the row."""
    rewards = Rewards(None, reward_fns, None)
    indices = [i for i, texts in enumerate(replies) for _ in texts]
    texts = [t for texts in replies for t in texts]
    means = {name: sum(values) / len(values) for k, (name, _) in enumerate(rewards.fns)
             for values in [rewards.task_scores(rows, indices, texts, k)]}
    return {**means, "reward": sum(means.values())}


def check_rewards(reward_fns: list, rows: list[PromptRow], where: str) -> None:
    """Before the model loads: each function imports and can be called as a reward, and each built-in finds its
    reference in every row."""
    for spec in reward_fns:
        load_reward_fn(spec)
    check_references(reward_fns, rows, where)
