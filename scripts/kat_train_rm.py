"""Train a reward model on preference pairs: frozen backbone (optionally its last N blocks trainable),
a linear head on the last real token, weighted Bradley–Terry loss over the global batch.

    python -m scripts.kat_train_rm --backbone CKPT --pairs pairs.jsonl
    torchrun --standalone --nproc_per_node=8 -m scripts.kat_train_rm -- --backbone CKPT --pairs pairs.jsonl

The weights it ends with do not depend on the number of ranks. The last line printed on success
names the checkpoint written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from nanochat_ext.cli import (MICRO_BATCH_HELP, MODEL_HELP, add_dashed_aliases, add_lora_args, add_output_args,
                              add_pairs_args, add_parallel_args, add_runtime_args, auto_micro_batch, check_consolidate,
                              check_flags, micro_batch, output_dirs, run_script, script_argv)
from nanochat_ext.data.batching import (BatchPlan, GlobalBatchLoader, by_length, collate_pairs, fit_max_len,
                                        rank_chunks, read_pairs, tokenize_splits)
from nanochat_ext.ddp_common import (DistEnv, all_reduce_sum, compute_dtype, peak_memory_gb, precision, print0,
                                     seed_everything)
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import hold_frozen_in
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for, merged_weights
from nanochat_ext.models.lora import (BEFORE_LORA, RESUME_KEYS, apply_lora, check_lora_args, describe as describe_lora,
                                      dropout_active, merge_now)
from nanochat_ext.models.reward_model import RM_STATS, RewardModel, rm_backward, trainable_state
from nanochat_ext.runtime.checkpoint import fingerprint, portable_paths, save_checkpoint, torch_load
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.parallel import Parallel, checkpoint_activations
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.training.memory import (FEWER_RANKS_STATE, LORA_STATE, StepMemory, auto_pick, backbone_shape,
                                          describe, doing, report_peak, rm_memory, smaller_micro)
from nanochat_ext.training.optim import guarded_step, make_optimizer
from nanochat_ext.training.tracking import WindowSums
from nanochat_ext.training.trainer import Saving, Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kat_train_rm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--backbone", required=True, help="the RM's backbone: " + MODEL_HELP)
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer dir (tokenizer.pkl or tokenizer.json); default: found beside the backbone, "
                        "else $NANOCHAT_BASE_DIR/tokenizer")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size", type=int, default=32, help="GLOBAL pairs per optimizer step (default: %(default)s)")
    g.add_argument("--device_batch_size", type=micro_batch, default=None, help="pairs " + MICRO_BATCH_HELP)
    g.add_argument("--max_steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warmup steps before cosine decay")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global grad norm to this (0: off)")
    g.add_argument("--seed", type=int, default=0, help="data order and head init (default: %(default)s)")
    g.add_argument("--unfreeze_last", default="0",
                   help="train the last N backbone blocks too, or 'all' for a full fine-tune (default: 0)")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval_every", type=int, default=50, help="validate every N steps, and at the end (0: end only)")
    g.add_argument("--log_every", type=int, default=10, help="print/log train metrics every N steps")
    add_pairs_args(p, "backbone")
    add_output_args(p, "rm_checkpoints")
    add_parallel_args(p)
    add_lora_args(p)
    add_runtime_args(p)
    add_dashed_aliases(p)
    args = p.parse_args(script_argv(argv))
    if args.unfreeze_last != "all" and not args.unfreeze_last.isdigit():
        p.error("--unfreeze_last must be a number of blocks or 'all'")
    return args


def train(args: argparse.Namespace, env: DistEnv) -> Path:
    seed_everything(args.seed)
    out_dir, log_dir = output_dirs(args, "rm_checkpoints")

    # ---- validate every input before anything is trained or written ---------------------------
    check_flags(args, {"weight_cap": (lambda v: v > 0, "> 0 (a pair's weight is clipped to it)")})
    check_consolidate(args)
    lora = check_lora_args(args)
    if lora and args.unfreeze_last != "0":
        raise InputError("--unfreeze_last trains whole blocks and --lora_r adapters on every block: give one of them")
    rows, train_rows, val_rows = read_pairs(args.pairs, args.density, args.val_ratio, args.skip_bad_rows)
    auto = auto_micro_batch(args, env.device)
    plan = BatchPlan.make(args.batch_size, env.world_size, None if auto else args.device_batch_size)
    resume = resolve_resume(args.resume, out_dir, "reward_model")
    backbone = load_backbone(args.backbone, env.device, vintage=args.nanochat_vintage)
    tokenizer = load_tokenizer_for(backbone, args.tokenizer)
    args.max_len = fit_max_len(args.max_len, backbone.max_seq_len, "backbone")
    backbone.set_trainable(args.unfreeze_last)
    for p in backbone.output_head_params():  # the RM reads hidden states; the LM head gets no gradient
        p.requires_grad_(False)
    if lora:  # before anything is written: peft refuses targets it cannot find
        apply_lora(backbone, lora)
        if any("lm_head" in n for n, p in backbone.named_parameters() if p.requires_grad):
            raise InputError("--lora_targets: an RM reads hidden states and never the LM head (lm_head): leave it out")
    claim_out_dir(out_dir, log_dir)

    dtype = compute_dtype(args.dtype, env.device)
    hold_frozen_in(backbone, dtype)
    train_pairs, val_pairs = tokenize_splits(train_rows, val_rows, tokenizer, args.max_len, args.long_pairs, args.pairs)
    loader = GlobalBatchLoader(len(train_pairs), plan, env.rank, args.seed)
    print0(f"data: {len(train_pairs)} train / {len(val_pairs)} val pairs from {args.pairs}, "
           f"{len({r.prefix_id for r in rows})} prompts; {loader.steps_per_epoch} steps per epoch")

    # ---- model, optimizer, resume ---------------------------------------------------------------
    model = RewardModel(backbone)
    model.init_head(args.seed)
    model.to(env.device)
    print0(compile_models(args.compile, env.device, backbone))
    if args.activation_checkpointing:
        checkpoint_activations(backbone.blocks)
    if lora:
        print0(describe_lora(backbone))
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print0(f"model: {backbone.kind} backbone {backbone.source}, tokenizer {tokenizer.kind}; "
           f"{n_trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,}")
    parallel = Parallel(args.parallel, env, dtype)
    ddp_model = parallel.wrap(model, backbone.blocks)
    print0(parallel.describe(model))
    trainable = [p for p in model.parameters() if p.requires_grad]  # after wrapping: FSDP's own parameters
    optimizer = make_optimizer("adamw", backbone.model, trainable, args.lr, args.weight_decay, env.device)
    backbone_print = fingerprint(backbone.source) if env.is_main else None  # recorded so a moved RM finds it

    def saving(step: int, into: Path, consolidate: bool) -> Saving:
        merge = lora is not None and merge_now(args, step, consolidate)

        def write_whole(d: Path, stamp: int, meta: dict, state: dict | None, weights: dict | None) -> Path:
            trained = trainable_state(model, weights)
            if merge:  # the head and the adapted weights merged (the adapters themselves stay in the resume state)
                merged = {f"backbone.model.{k}": v for k, v in merged_weights(backbone, adapted_only=True).items()}
                trained, state = {"head.weight": trained["head.weight"], **merged}, state and {**state, "trained": trained}
            return save_checkpoint(d, stamp, trained, meta, state)

        meta = {"backbone": str(Path(backbone.source).resolve()), "backbone_kind": backbone.kind,
                "backbone_ref": {**portable_paths(backbone.source, into), "given": args.backbone,
                                 "fingerprint": backbone_print},
                "tokenizer_ref": portable_paths(tokenizer.source, into),
                "backbone_vintage": backbone.vintage,
                "tokenizer": str(Path(tokenizer.source).resolve()), "tokenizer_kind": tokenizer.kind,
                "max_len": args.max_len, "dtype": str(dtype).removeprefix("torch."),
                "unfreeze_last": args.unfreeze_last, "hidden_size": backbone.hidden_size,
                "lora": lora and {**lora.to_meta(), "merged": merge}}
        return Saving(meta, write_whole, {"device_batch_size": plan.device_batch_size})

    trainer = Trainer(args, env, parallel, model, optimizer, module=model, kind="reward_model", out_dir=out_dir,
                      saving=saving)
    start_step = trainer.resume(resume, RESUME_FLAGS, lambda state: load_trained(model, state, resume[0]),
                                absent=BEFORE_LORA)
    if args.consolidate:
        return trainer.consolidate(resume)
    autocast = precision(dtype, env.device)

    # ---- train ----------------------------------------------------------------------------------
    shape = backbone_shape(backbone)

    def estimate_for(micro: int) -> StepMemory:  # at --max_len, every pair's longest
        return rm_memory(shape, parallel=args.parallel, ranks=env.world_size,
                         checkpointing=args.activation_checkpointing, pairs=micro, seq_len=args.max_len,
                         accum=plan.per_rank // micro if getattr(model, "accumulate_unsharded", True) else 1,
                         unfreeze=args.unfreeze_last,
                         lora=sum(p.numel() for p in backbone.parameters() if p.requires_grad) if lora else 0,
                         device=env.device.type)

    if auto:
        micro, line = auto_pick(plan.per_rank, estimate_for, env.device, resume)
        print0(line)
        plan = BatchPlan.make(args.batch_size, env.world_size, micro)
        loader = GlobalBatchLoader(len(train_pairs), plan, env.rank, args.seed)
    print0(f"batch: {plan.batch_size} global = {env.world_size} ranks x {plan.accum_steps} micro-batches x "
           f"{plan.device_batch_size} pairs")
    estimate = estimate_for(plan.device_batch_size)
    print0(describe(estimate, plan.device_batch_size))
    trainer.start(log_dir, "rm")
    # LoRA takes less than unfrozen blocks, not than a frozen backbone (its backward runs through every block)
    lora_hint = (LORA_STATE.replace("--lora_r 16", "--lora_r 16 --unfreeze_last 0"),) if args.unfreeze_last != "0" else ()
    window = WindowSums([*RM_STATS, "steps"])  # this rank's sums since the last log
    for step in range(start_step, args.max_steps):
        micro_batches = by_length(loader.micro_batches(step), lambda i: train_pairs[i].row_length)
        batches = [collate_pairs([train_pairs[i] for i in mb], tokenizer.pad_id) for mb in micro_batches]
        lr = trainer.set_lr(step)
        done = step + 1
        with doing(f"a training micro-batch of {plan.device_batch_size} pairs",
                   (*smaller_micro(plan.device_batch_size, plan.per_rank), "--activation_checkpointing",
                    FEWER_RANKS_STATE, *lora_hint)), dropout_active(backbone):
            stats = rm_backward(ddp_model, batches, args.weight_mode, args.weight_cap, env.device, autocast)
        with doing("the optimizer step", (FEWER_RANKS_STATE, *lora_hint)):
            grad_norm = guarded_step(optimizer, trainable, args.grad_clip, trainer.guard, done, stats[0].item())
        window.add(**dict(zip(RM_STATS, stats.tolist())), steps=1)
        trainer.tracker.advance()
        if trainer.log_due(done):
            s = window.reduced()  # every rank's loss is its share of the global one; steps count once per rank
            elapsed = trainer.elapsed()
            trainer.log(done, {"train/loss": s["loss"] / (s["steps"] / env.world_size),
                               "train/accuracy": s["correct"] / s["pairs"], "train/margin": s["margin"] / s["pairs"],
                               "train/lr": lr, "train/grad_norm": grad_norm,
                               "perf/pairs_per_s": s["pairs"] / elapsed, "perf/tokens_per_s": s["tokens"] / elapsed,
                               "perf/computed_tokens_per_s": s["computed"] / elapsed, **peak_memory_gb(env.device)})
            window.zero()
        if trainer.eval_due(done):
            with trainer.evaluating(done, f"validation, {plan.device_batch_size} pairs at a time",
                                    smaller_micro(plan.device_batch_size, plan.per_rank)):
                val = evaluate(model, val_pairs, env, plan.device_batch_size, tokenizer.pad_id, autocast) if val_pairs else {}
            trainer.evaluated(done, val)
        trainer.end_step(done)
    report_peak(env.device, estimate)
    return trainer.finish()


@torch.no_grad()
def evaluate(model: RewardModel, pairs: list, env: DistEnv, batch: int, pad_id: int, autocast) -> dict:
    """Validation accuracy / margin / loss over all ranks: each rank scores every W-th pair. Every rank runs as
    many forwards as the rank with the most (one with fewer scores a pair it then leaves out): under --parallel fsdp
    each forward gathers the weights from every rank."""
    stats = torch.zeros(4, dtype=torch.float64)  # correct, margin, loss, n
    for chunk in rank_chunks(len(pairs), env.world_size, env.rank, batch):
        b = collate_pairs([pairs[i] for i in chunk or [0]], pad_id)
        n = b["weights"].numel()
        with autocast:
            r = model(b["input_ids"].to(env.device), b["lengths"].to(env.device)).float()
        if not chunk:
            continue
        margin = (r[:n] - r[n:]).double().cpu()
        stats += torch.tensor([(margin > 0).sum().item(), margin.sum().item(),
                               torch.nn.functional.softplus(-margin).sum().item(), n], dtype=torch.float64)
    stats = all_reduce_sum(stats)
    n = max(stats[3].item(), 1.0)
    return {"val/accuracy": stats[0].item() / n, "val/margin": stats[1].item() / n, "val/loss": stats[2].item() / n}


# The flags a resumed RM must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "seed", "unfreeze_last", "weight_mode", "weight_cap", "max_len", "long_pairs", *RESUME_KEYS)


def load_trained(model: RewardModel, state: dict, model_path: Path) -> None:
    """A whole checkpoint's trained tensors into the model: the model file's, or, where it holds merged weights
    (--merge_lora), the resume state's adapters."""
    weights = state.get("trained") or torch_load(model_path, "reward-model checkpoint")
    params = dict(model.named_parameters())
    if set(weights) != {n for n, p in params.items() if p.requires_grad}:
        raise InputError("checkpoint's trainable tensors do not match this run's --unfreeze_last and --lora_*",
                         path=str(model_path))
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")

if __name__ == "__main__":
    sys.exit(main())
