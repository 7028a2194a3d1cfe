"""Supervised fine-tuning of a chat model on conversations: next-token loss on the last assistant
reply, averaged over the reply tokens of the global batch. The demo pipeline uses it to make the
tiny policy that RM and GRPO start from; it works on any nanochat or local HF checkpoint.

    python -m scripts.kat_sft --backbone BASE_CKPT --conversations convs.jsonl
    torchrun --standalone --nproc_per_node=2 -m scripts.kat_sft -- --backbone ... --conversations ...

Conversations: JSONL {"messages": [{"role": "user", ...}, ..., {"role": "assistant", ...}]}.
The model is saved as a nanochat checkpoint (HF models as a model_<unix>/ dir); the last line
printed on success names it.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.sft import SFT, SPEC, sft_examples
from nanochat_ext.algorithms.trainers import WRITERS
from nanochat_ext.cli import (
    RunConfig,
    add_config,
    add_training,
    command_line_run,
    config,
    configs,
    recorded,
    run_script,
    trainer_parser,
)
from nanochat_ext.data.conversations import load_conversations
from nanochat_ext.ddp_common import print0, seed_everything
from nanochat_ext.errors import InputError
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.runtime.session import Session
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import backbone_shape, fine_tune_memory, micro_batch_for
from nanochat_ext.training.setup import Checks, PolicyTraining, load_policy

# The flags a resumed run must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "seed", "max_len")


def flags() -> argparse.ArgumentParser:
    p, g = trainer_parser(SPEC.name, __doc__)
    g.add_argument("--conversations", required=True,
                   help="{messages: [...]} ending with the turns to learn after the last user turn (a string, "
                        "nanochat's parts, or tool calls and tool turns for a chat model), or GSM8K's {question, "
                        "answer} rows; as JSONL, parquet, Arrow or a datasets dir")
    add_config(p, AgentConfig, SPEC.name, "tools (as GRPO will run them)", only=("tools", "tool_format"))
    add_training(p, SPEC.name)
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run the command line asks for."""
    return command_line_run(flags(), argv)


def train(args: RunConfig, session: Session) -> Path:
    env, c = session.env, configs(args, SPEC.name)
    seed_everything(args.seed)
    out_dir, log_dir = c.out.dirs(SPEC.words["stage_dir"], "default")

    # ---- inputs, checked before anything is written --------------------------------------------------
    conversations = load_conversations(args.conversations)
    share = c.batch.loader(len(conversations), env.world_size, env.rank).plan.per_rank  # checks the batch splits
    resume = resolve_resume(c.out.resume, out_dir, SPEC, WRITERS)
    loaded = load_policy(args.backbone, c.model, env, lora=None)
    max_len = c.data.max_len or loaded.backbone.max_seq_len
    if max_len > loaded.backbone.max_seq_len:
        raise InputError(f"--max_len {max_len} exceeds the model's context of {loaded.backbone.max_seq_len}")
    claim_out_dir(out_dir, log_dir)
    agent = Agent(config(AgentConfig, args), loaded.tok)
    print0(agent.describe())
    examples = sft_examples(conversations, loaded.tok, max_len, agent, args.conversations)

    # ---- the model, the batches, the loop ------------------------------------------------------------
    flags = recorded(args, c.optim)
    training = PolicyTraining(loaded, c.model, c.optim, env, spec=SPEC, reference=False, resume=resume,
                              checks=Checks(flags, RESUME_FLAGS, {}))
    loop = Loop(training, c.loop, c.out, c.optim, out_dir, log_dir, flags, session)
    if c.out.consolidate:
        return loop.consolidate(resume)
    estimate_for = functools.partial(
        fine_tune_memory, backbone_shape(loaded.backbone), parallel=c.model.parallel, ranks=env.world_size,
        checkpointing=c.model.activation_checkpointing, row_len=max(len(p) + len(r) for p, r, _ in examples),
        scored=max(len(r) for _, r, _ in examples), pairs=share, reference=False, device=env.device.type,
        accum=None if getattr(training.model, "accumulate_unsharded", True) else 1)
    micro, estimate = micro_batch_for(c.batch.device_batch_size, share, estimate_for, env.device, resume)
    loader = c.batch.loader(len(examples), env.world_size, env.rank, micro)
    print0(f"data: {len(examples)} conversations from {args.conversations}; {loader.steps_per_epoch} steps per epoch")
    return loop.run(SFT(training, examples, loader, estimate))


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")

