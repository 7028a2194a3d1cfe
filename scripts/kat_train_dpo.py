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
import sys
from pathlib import Path

from nanochat_ext.algorithms.dpo import (DPO_LOSSES, DPO_STATS, DPOConfig, dpo_backward, dpo_evaluate, dpo_metrics,
                                         precompute_reference, reference_logps, pair_sequences)
from nanochat_ext.cli import (MICRO_BATCH_HELP, MODEL_HELP, add_dashed_aliases, add_lora_args, add_output_args,
                              add_pairs_args, add_parallel_args, add_runtime_args, auto_micro_batch, check_consolidate,
                              check_flags, micro_batch, output_dirs, run_script, script_argv, steps_from_epochs)
from nanochat_ext.data.batching import BatchPlan, GlobalBatchLoader, by_length, fit_max_len, read_pairs, tokenize_splits
from nanochat_ext.ddp_common import DistEnv, peak_memory_gb, print0, seed_everything
from nanochat_ext.errors import InputError
from nanochat_ext.models.lora import BEFORE_LORA, RESUME_KEYS, check_lora_args, dropout_active
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.training.memory import (FEWER_RANKS_STATE, LORA_STATE, auto_pick, backbone_shape, describe, doing,
                                          dpo_memory, report_peak, smaller_micro)
from nanochat_ext.training.optim import LR_DECAYS, OPTIMIZERS, check_optimizer, guarded_step
from nanochat_ext.training.policy import PolicyTraining
from nanochat_ext.training.tracking import WindowSums


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kat_train_dpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--policy", required=True, help="the model to train: " + MODEL_HELP)
    g.add_argument("--reference", default=None,
                   help="the frozen reference, a checkpoint of the policy's architecture (default: the policy as it "
                        "starts; with --lora_r, the policy with its adapters off)")
    g.add_argument("--tokenizer", default=None, help="default: found beside the policy, else $NANOCHAT_BASE_DIR/tokenizer")
    g = p.add_argument_group("loss")
    g.add_argument("--loss_type", choices=DPO_LOSSES, default="sigmoid",
                   help="sigmoid: DPO; ipo: IPO (log-ratios averaged per token, as TRL); hinge: SLiC's; simpo: SimPO "
                        "(average log-probs, no reference) (default: %(default)s)")
    g.add_argument("--beta", type=float, default=0.1,
                   help="the KL strength (DPO's beta; IPO's tau; SimPO's reward scale) (default: %(default)s)")
    g.add_argument("--label_smoothing", type=float, default=0.0,
                   help="cDPO: the share of labels taken to be flipped, in [0, 0.5) (sigmoid and simpo)")
    g.add_argument("--simpo_gamma", type=float, default=0.5, help="SimPO's target reward margin (default: %(default)s)")
    g.add_argument("--precompute_ref_logps", action="store_true",
                   help="the reference's log-probs of every pair once before training, then the reference is freed "
                        "(worth it for a run of one epoch or more); default: computed with each step's pairs, as TRL "
                        "does")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size", type=int, default=32, help="GLOBAL pairs per optimizer step (default: %(default)s)")
    g.add_argument("--device_batch_size", type=micro_batch, default=None, help="pairs " + MICRO_BATCH_HELP)
    g.add_argument("--max_steps", type=int, default=None, help="optimizer steps (default: --num_epochs's, else 100)")
    g.add_argument("--num_epochs", type=int, help="--max_steps, where not given: train pairs // --batch_size x E")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw; or muon, nanochat's MuonAdamW for nanochat policies (--lr is then the fraction of "
                        "nanochat's learning rates) (default: adamw)")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (adamw; default 1e-6, TRL's); with --optimizer muon the fraction of "
                        "nanochat's learning rates (default 0.05)")
    g.add_argument("--warmup_steps", type=int, default=0)
    g.add_argument("--lr_decay", choices=LR_DECAYS, default="cosine", help="after the warmup (default: cosine)")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global grad norm (0: off)")
    g.add_argument("--seed", type=int, default=0, help="data order (default: %(default)s)")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval_every", type=int, default=50, help="validate every N steps, and at the end (0: end only)")
    g.add_argument("--log_every", type=int, default=10, help="log train metrics every N steps")
    add_pairs_args(p, "policy")
    add_output_args(p, "dpo_checkpoints")
    add_parallel_args(p)
    add_lora_args(p)
    add_runtime_args(p)
    add_dashed_aliases(p)
    args = p.parse_args(script_argv(argv))
    if args.lr is None:
        args.lr = 0.05 if args.optimizer == "muon" else 1e-6
    return args


DPO_RANGES = {
    "beta": (lambda v: 0 < v < float("inf"), "a finite number > 0 (the loss divides by it or scales by it)"),
    "label_smoothing": (lambda v: 0 <= v < 0.5, "in [0, 0.5): the share of labels taken to be flipped"),
    "simpo_gamma": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "weight_cap": (lambda v: v > 0, "> 0 (a pair's weight is clipped to it)"),
}


def train(args: argparse.Namespace, env: DistEnv) -> Path:
    seed_everything(args.seed)

    # ---- validate every input before anything is trained or written ---------------------------
    check_flags(args, DPO_RANGES)
    if args.label_smoothing and args.loss_type not in ("sigmoid", "simpo"):
        raise InputError(f"--label_smoothing applies to --loss_type sigmoid and simpo, not {args.loss_type}")
    if args.loss_type == "simpo" and (args.reference or args.precompute_ref_logps):
        flag = "--reference" if args.reference else "--precompute_ref_logps"
        raise InputError(f"{flag}: --loss_type simpo uses no reference; leave {flag} out")
    check_consolidate(args)
    lora = check_lora_args(args)
    check_optimizer(args.optimizer, bool(lora), args.parallel)
    cfg = DPOConfig(args.loss_type, args.beta, args.label_smoothing, args.simpo_gamma, args.weight_mode,
                    args.weight_cap)
    rows, train_rows, val_rows = read_pairs(args.pairs, args.density, args.val_ratio, args.skip_bad_rows)
    auto = auto_micro_batch(args, env.device)
    plan = BatchPlan.make(args.batch_size, env.world_size, None if auto else args.device_batch_size)
    training = PolicyTraining(args, env, lora)
    policy, tok = training.policy, training.tok
    out_dir, log_dir = output_dirs(args, "dpo_checkpoints")
    resume = resolve_resume(args.resume, out_dir, "dpo_policy")
    args.max_len = fit_max_len(args.max_len, policy.max_seq_len, "policy")
    train_pairs, val_pairs = tokenize_splits(train_rows, val_rows, tok, args.max_len, args.long_pairs, args.pairs)
    steps_from_epochs(args, len(train_pairs), args.batch_size, "pairs")
    loader = GlobalBatchLoader(len(train_pairs), plan, env.rank, args.seed)
    claim_out_dir(out_dir, log_dir)
    print0(f"data: {len(train_pairs)} train / {len(val_pairs)} val pairs from {args.pairs}, "
           f"{len({r.prefix_id for r in rows})} prompts; {loader.steps_per_epoch} steps per epoch")

    # ---- models, optimizer, resume ----------------------------------------------------------------
    model = training.build(cfg.uses_reference)
    training.wrap()
    training.state["device_batch_size"] = plan.device_batch_size  # what a save before any step records
    trainer = training.trainer(out_dir, "dpo_policy", resume, RESUME_FLAGS, BEFORE_LORA)
    print0(training.describe())
    if args.consolidate:
        return trainer.consolidate(resume)
    ddp_model, autocast = training.ddp_model, training.autocast
    reference = training.reference

    # ---- train ------------------------------------------------------------------------------------
    estimate_for = functools.partial(
        dpo_memory, backbone_shape(policy), parallel=args.parallel, ranks=env.world_size,
        checkpointing=args.activation_checkpointing, row_len=max(p.row_length for p in train_pairs),
        scored=max(len(p.chosen) + len(p.rejected) - 2 * p.prompt_len for p in train_pairs),
        pairs=plan.per_rank, accum=None if getattr(model, "accumulate_unsharded", True) else 1,
        reference=reference is not None and not args.precompute_ref_logps, device=env.device.type,
        lora=sum(p.numel() for p in training.trainable) if lora else 0)
    if auto:
        pairs, line = auto_pick(plan.per_rank, estimate_for, env.device, resume)
        print0(line)
        plan = BatchPlan.make(args.batch_size, env.world_size, pairs)
        loader = GlobalBatchLoader(len(train_pairs), plan, env.rank, args.seed)
    training.state["device_batch_size"] = plan.device_batch_size
    micro = 2 * plan.device_batch_size  # sequences: a pair's two responses
    print0(f"batch: {plan.batch_size} global pairs = {env.world_size} ranks x {plan.accum_steps} micro-batches x "
           f"{plan.device_batch_size} pairs; loss {cfg.loss_type}, beta {cfg.beta}")
    estimate = estimate_for(micro=plan.device_batch_size)
    print0(describe(estimate, plan.device_batch_size))
    if reference is not None and args.precompute_ref_logps:
        with doing(f"the reference's log-probs, {plan.device_batch_size} pairs at a time",
                   smaller_micro(plan.device_batch_size, plan.per_rank)):
            precompute_reference(reference, train_pairs + val_pairs, tok.pad_id, plan.device_batch_size,
                                 env.world_size, env.rank, env.device, autocast)
        print0(f"reference: log-probs of {len(train_pairs) + len(val_pairs)} pairs computed once, before training")
        reference = training.reference = None
    elif reference is not None:
        print0("reference: log-probs computed with each step's pairs (--precompute_ref_logps: once, before training)")
    trainer.start(log_dir, "dpo")
    window = WindowSums([*DPO_STATS, "steps"])  # this rank's sums since the last log
    for step in range(trainer.start_step, args.max_steps):
        mine = [i for mb in by_length(loader.micro_batches(step), lambda i: train_pairs[i].row_length) for i in mb]
        batch = pair_sequences([train_pairs[i] for i in mine], tok.pad_id)
        lr = trainer.set_lr(step)
        done = step + 1
        if reference is not None:
            with doing(f"the reference's log-probs, {plan.device_batch_size} pairs at a time",
                       smaller_micro(plan.device_batch_size, plan.per_rank)):
                batch["ref"] = reference_logps(reference, batch, micro, env.device, autocast)
        with doing(f"a training micro-batch of {plan.device_batch_size} pairs",
                   (*smaller_micro(plan.device_batch_size, plan.per_rank), "--activation_checkpointing",
                    FEWER_RANKS_STATE, LORA_STATE)), dropout_active(policy):
            stats = dpo_backward(ddp_model, batch, micro, cfg, env.device, autocast)
        with doing("the optimizer step", (FEWER_RANKS_STATE, LORA_STATE)):
            grad_norm = guarded_step(training.optimizer, training.trainable, args.grad_clip, trainer.guard, done,
                                     stats[0].item())
        window.add(**dict(zip(DPO_STATS, stats.tolist())), steps=1)
        trainer.tracker.advance()
        if trainer.log_due(done):
            s = window.reduced()  # every rank's loss is its share of the global one; steps count once per rank
            elapsed = trainer.elapsed()
            trainer.log(done, {"train/loss": s["loss"] / (s["steps"] / env.world_size), **dpo_metrics(s),
                               "train/lr": lr, "train/grad_norm": grad_norm,
                               "perf/pairs_per_s": s["pairs"] / elapsed, "perf/tokens_per_s": s["tokens"] / elapsed,
                               "perf/computed_tokens_per_s": s["computed"] / elapsed, **peak_memory_gb(env.device)})
            window.zero()
        if trainer.eval_due(done):
            with trainer.evaluating(done, f"validation, {plan.device_batch_size} pairs at a time",
                                    smaller_micro(plan.device_batch_size, plan.per_rank)):
                val = dpo_evaluate(model, reference, val_pairs, tok.pad_id, plan.device_batch_size, cfg,
                                   env.world_size, env.rank, env.device, autocast) if val_pairs else {}
            trainer.evaluated(done, val)
        trainer.end_step(done)
    report_peak(env.device, estimate)
    return trainer.finish()


# The flags a resumed run must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "seed", "loss_type", "beta", "label_smoothing", "simpo_gamma", "weight_mode",
                "weight_cap", "max_len", "long_pairs", "optimizer", "reference", "precompute_ref_logps", *RESUME_KEYS)


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")


if __name__ == "__main__":
    sys.exit(main())
