"""Train a reward model on preference pairs: frozen backbone (optionally its last N blocks trainable),
a linear head on the last real token, weighted Bradley–Terry loss over the global batch.

    python -m scripts.kat_train_rm --backbone CKPT --pairs pairs.jsonl
    torchrun --standalone --nproc_per_node=8 -m scripts.kat_train_rm -- --backbone CKPT --pairs pairs.jsonl

The weights it ends with do not depend on the number of ranks. The last line printed on success
names the checkpoint written.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

from nanochat_ext.algorithms.rm import RESUME_FLAGS, SPEC, RewardModelMethod, RMConfig
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
from nanochat_ext.data.batching import PairsConfig, fit_max_len, read_pairs, tokenize_splits
from nanochat_ext.data.rows import DataConfig
from nanochat_ext.ddp_common import print0, seed_everything
from nanochat_ext.models.lora import BEFORE_LORA, RESUME_KEYS
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.resume import resolve_resume, started_lr
from nanochat_ext.runtime.session import Session
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import backbone_shape, micro_batch_for, rm_memory
from nanochat_ext.training.setup import Checks, RewardModelTraining, load_rm_backbone


def flags() -> argparse.ArgumentParser:
    p, _ = trainer_parser(SPEC.name, __doc__)
    add_config(p, PairsConfig, SPEC.name, "pairs")
    add_config(p, RMConfig, SPEC.name, "what trains")
    add_training(p, SPEC.name, lora=True)
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run the command line asks for."""
    return command_line_run(flags(), argv)


def train(args: RunConfig, session: Session) -> Path:
    pairs_cfg, rm = config(PairsConfig, args), config(RMConfig, args)
    rm.check()
    env, c = session.env, configs(args, SPEC.name, adamw_lr=rm.default_lr(bool(args.lora_r)))
    seed_everything(args.seed)
    if warning := rm.lr_warning(c.optim.lr, args.lr is not None, bool(args.lora_r)):
        print0(warning)
    out_dir, log_dir = c.out.dirs(SPEC.words["stage_dir"], "density" if c.data.density else "uniform")

    # ---- inputs, checked before anything is trained or written --------------------------------------------
    rows, train_rows, val_rows = read_pairs(pairs_cfg.pairs, c.data.density, c.data.val_ratio, pairs_cfg.skip_bad_rows)
    share = c.batch.plan(env.world_size).per_rank  # one line where the batch does not split over the ranks
    resume = resolve_resume(c.out.resume, out_dir, SPEC, WRITERS)
    c = dataclasses.replace(c, optim=started_lr(c.optim, args.lr is not None, resume))
    backbone, tok = load_rm_backbone(args.backbone, c.model, env, rm.unfreeze_last, c.lora.spec)
    max_len = fit_max_len(c.data.max_len, backbone.max_seq_len, "backbone")
    claim_out_dir(out_dir, log_dir)
    train_pairs, val_pairs = tokenize_splits(train_rows, val_rows, tok, max_len, pairs_cfg.long_pairs, pairs_cfg.pairs)
    loader = c.batch.loader(len(train_pairs), env.world_size, env.rank)
    print0(f"data: {len(train_pairs)} train / {len(val_pairs)} val pairs from {pairs_cfg.pairs}, "
           f"{len({r.prefix_id for r in rows})} prompts; {loader.steps_per_epoch} steps per epoch")

    # ---- the model, resume ------------------------------------------------------------------------------------
    flags = recorded(args, c.optim, c.lora, DataConfig(c.data.density, c.data.val_ratio, max_len))
    training = RewardModelTraining(backbone, tok, c.model, c.optim, env, given=args.backbone,
                                   unfreeze_last=rm.unfreeze_last, lora=c.lora.spec, max_len=max_len, seed=c.batch.seed,
                                   resume=resume, checks=Checks(flags, RESUME_FLAGS + RESUME_KEYS, BEFORE_LORA),
                                   merge_lora=c.lora.merge_lora)
    loop = Loop(training, c.loop, c.out, c.optim, out_dir, log_dir, flags, session)
    if c.out.consolidate:
        return loop.consolidate(resume)

    # ---- micro-batches by memory, the loop ----------------------------------------------------------------------
    estimate_for = functools.partial(  # at --max_len, every pair's longest
        rm_memory, backbone_shape(backbone), parallel=c.model.parallel, ranks=env.world_size,
        checkpointing=c.model.activation_checkpointing, seq_len=max_len, unfreeze=rm.unfreeze_last,
        pairs=share, accum=None if getattr(training.model, "accumulate_unsharded", True) else 1,
        lora=sum(p.numel() for p in backbone.parameters() if p.requires_grad) if c.lora.lora_r else 0,
        device=env.device.type)
    micro, estimate = micro_batch_for(c.batch.device_batch_size, share, estimate_for, env.device, resume)
    loader = c.batch.loader(len(train_pairs), env.world_size, env.rank, micro)
    plan = loader.plan
    print0(f"batch: {plan.batch_size} global = {env.world_size} ranks x {plan.accum_steps} micro-batches x "
           f"{plan.device_batch_size} pairs")
    return loop.run(RewardModelMethod(training, pairs_cfg.weight_mode, pairs_cfg.weight_cap, train_pairs, val_pairs,
                                      loader, estimate))


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")

