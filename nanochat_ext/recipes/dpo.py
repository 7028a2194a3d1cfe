"""Direct preference optimisation: the policy learns from preference pairs without a reward model. Each pair's
chosen and rejected responses are scored by their log-probs under the policy against a frozen reference (the
starting policy, or --reference), with DPO's sigmoid loss (cDPO label smoothing), IPO, hinge, or the reference-free
SimPO; each pair weighted by its density weight over the global batch, as the reward model's loss is.

    python -m scripts.kat_train_dpo --policy SFT_CKPT --pairs pairs.jsonl
    torchrun --standalone --nproc_per_node=8 -m scripts.kat_train_dpo -- --policy SFT_CKPT --pairs pairs.jsonl

The policy is saved as a nanochat checkpoint (or an HF dir) that loads again as --policy/--backbone; the weights it
ends with do not depend on the number of ranks. The last line printed on success names the checkpoint written.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

from nanochat_ext.algorithms.dpo import DPO, RESUME_FLAGS, SPEC, DPOConfig, precompute_reference
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
from nanochat_ext.runtime.oom import smaller_micro
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.runtime.session import Session
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import backbone_shape, fine_tune_memory, micro_batch_for
from nanochat_ext.training.setup import Checks, PolicyTraining, load_policy


def flags() -> argparse.ArgumentParser:
    p, g = trainer_parser(SPEC.name, __doc__)
    g.add_argument("--reference", default=None,
                   help="the frozen reference, a checkpoint of the policy's architecture (default: the policy as it "
                        "starts; with --lora_r, the policy with its adapters off)")
    add_config(p, PairsConfig, SPEC.name, "pairs")
    add_config(p, DPOConfig, SPEC.name, "loss")
    add_training(p, SPEC.name, lora=True)
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run the command line asks for."""
    return command_line_run(flags(), argv)


def train(args: RunConfig, session: Session) -> Path:
    env, c = session.env, configs(args, SPEC.name)
    seed_everything(args.seed)
    pairs_cfg, cfg = config(PairsConfig, args), config(DPOConfig, args)
    cfg.check(args.reference)

    # ---- inputs, checked before anything is trained or written --------------------------------------------
    rows, train_rows, val_rows = read_pairs(pairs_cfg.pairs, c.data.density, c.data.val_ratio, pairs_cfg.skip_bad_rows)
    loaded = load_policy(args.policy, c.model, env, c.lora.spec, c.optim.optimizer, args.reference)
    out_dir, log_dir = c.out.dirs(SPEC.words["stage_dir"], "density" if c.data.density else "uniform")
    resume = resolve_resume(c.out.resume, out_dir, SPEC, WRITERS)
    max_len = fit_max_len(c.data.max_len, loaded.backbone.max_seq_len, "policy")
    train_pairs, val_pairs = tokenize_splits(train_rows, val_rows, loaded.tok, max_len, pairs_cfg.long_pairs,
                                             pairs_cfg.pairs)
    loop_cfg = c.loop.with_steps(len(train_pairs), c.batch.batch_size, "pairs")
    share = c.batch.loader(len(train_pairs), env.world_size, env.rank).plan.per_rank  # checks the batch splits
    claim_out_dir(out_dir, log_dir)

    # ---- the model, its reference, resume -------------------------------------------------------------------
    flags = recorded(args, c.optim, loop_cfg, c.lora, DataConfig(c.data.density, c.data.val_ratio, max_len))
    training = PolicyTraining(loaded, c.model, c.optim, env, spec=SPEC, reference=cfg.uses_reference,
                              resume=resume, checks=Checks(flags, RESUME_FLAGS + RESUME_KEYS, BEFORE_LORA),
                              merge_lora=c.lora.merge_lora)
    print0(training.describe())
    loop = Loop(training, loop_cfg, c.out, c.optim, out_dir, log_dir, flags, session)
    if c.out.consolidate:
        return loop.consolidate(resume)

    # ---- micro-batches by memory, the reference's log-probs, the loop ------------------------------------------
    reference = training.reference
    estimate_for = functools.partial(
        fine_tune_memory, backbone_shape(loaded.backbone), parallel=c.model.parallel, ranks=env.world_size,
        checkpointing=c.model.activation_checkpointing, row_len=max(p.row_length for p in train_pairs),
        scored=max(len(p.chosen) + len(p.rejected) - 2 * p.prompt_len for p in train_pairs), pairs=share,
        accum=None if getattr(training.model, "accumulate_unsharded", True) else 1,
        reference=reference is not None and not cfg.precompute_ref_logps, device=env.device.type,
        lora=sum(p.numel() for p in training.trainable) if c.lora.lora_r else 0)
    micro, estimate = micro_batch_for(c.batch.device_batch_size, share, estimate_for, env.device, resume)
    loader = c.batch.loader(len(train_pairs), env.world_size, env.rank, micro)
    plan = loader.plan
    print0(f"data: {len(train_pairs)} train / {len(val_pairs)} val pairs from {pairs_cfg.pairs}, "
           f"{len({r.prefix_id for r in rows})} prompts; {loader.steps_per_epoch} steps per epoch")
    print0(f"batch: {plan.batch_size} global pairs = {env.world_size} ranks x {plan.accum_steps} micro-batches x "
           f"{plan.device_batch_size} pairs; loss {cfg.loss_type}, beta {cfg.beta}")
    if reference is not None and cfg.precompute_ref_logps:
        with session.progress.doing(f"the reference's log-probs, {micro} pairs at a time",
                                    smaller_micro(micro, share)):
            precompute_reference(reference, train_pairs + val_pairs, loaded.tok.pad_id, micro, env.world_size,
                                 env.rank, env.device, training.autocast)
        print0(f"reference: log-probs of {len(train_pairs) + len(val_pairs)} pairs computed once, before training")
        training.drop_reference()
        reference = None
    elif reference is not None:
        print0("reference: log-probs computed with each step's pairs (--precompute_ref_logps: once, before training)")
    return loop.run(DPO(training, cfg, reference, train_pairs, val_pairs, loader, estimate))


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")

