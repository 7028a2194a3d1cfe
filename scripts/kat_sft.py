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
import sys
from pathlib import Path

from nanochat_ext.cli import (MODEL_HELP, add_dashed_aliases, add_output_args, add_parallel_args, add_runtime_args,
                              check_consolidate, check_flags, output_dirs, run_script, script_argv)
from nanochat_ext.data.batching import BatchPlan, GlobalBatchLoader, cut_to_fit
from nanochat_ext.data.rows import load_conversations
from nanochat_ext.ddp_common import DistEnv, compute_dtype, precision, print0, seed_everything
from nanochat_ext.errors import InputError
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.runtime.checkpoint import is_shards, resolve_model_path
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.parallel import Parallel, checkpoint_activations
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.training.logprobs import CompletionLogprobs, make_sequences, sft_backward
from nanochat_ext.training.memory import FEWER_RANKS_STATE, doing, smaller_micro
from nanochat_ext.training.optim import guarded_step, make_optimizer
from nanochat_ext.training.tracking import WindowSums
from nanochat_ext.training.trainer import Saving, Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kat_sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("inputs")
    g.add_argument("--backbone", required=True, help="model to fine-tune: " + MODEL_HELP)
    g.add_argument("--tokenizer", default=None, help="default: found beside the backbone, else $NANOCHAT_BASE_DIR/tokenizer")
    g.add_argument("--conversations", required=True,
                   help="{messages: [...]} ending with the reply to learn (a string, or nanochat's parts with tool "
                        "calls), or GSM8K's {question, answer} rows; as JSONL, parquet, Arrow or a datasets dir")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size", type=int, default=32, help="GLOBAL conversations per step (default: %(default)s)")
    g.add_argument("--device_batch_size", type=int, default=None, help="conversations per forward on each rank")
    g.add_argument("--max_steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    g.add_argument("--warmup_steps", type=int, default=10)
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global grad norm (0: off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max_len", type=int, default=None, help="tokens per conversation (default: the model's context)")
    g.add_argument("--log_every", type=int, default=20, help="log train metrics every N steps")
    add_output_args(p, "chatsft_checkpoints", tag_help="'default'")
    add_parallel_args(p)
    add_runtime_args(p)
    add_dashed_aliases(p)
    return p.parse_args(script_argv(argv))


def train(args: argparse.Namespace, env: DistEnv) -> Path:
    seed_everything(args.seed)
    out_dir, log_dir = output_dirs(args, "chatsft_checkpoints", default_tag="default")
    check_flags(args)
    check_consolidate(args)
    conversations = load_conversations(args.conversations)
    plan = BatchPlan.make(args.batch_size, env.world_size, args.device_batch_size)
    loader = GlobalBatchLoader(len(conversations), plan, env.rank, args.seed)
    resume = resolve_resume(args.resume, out_dir, "sft")
    whole = resume is not None and not is_shards(resume[0])  # a whole checkpoint holds the weights; shards load later
    model_bb = load_backbone(resume[0] if whole else args.backbone, env.device, vintage=args.nanochat_vintage)
    tok = load_tokenizer_for(model_bb, args.tokenizer)
    max_len = args.max_len or model_bb.max_seq_len
    if max_len > model_bb.max_seq_len:
        raise InputError(f"--max_len {max_len} exceeds the model's context of {model_bb.max_seq_len}")
    claim_out_dir(out_dir, log_dir)

    # (prompt ids, reply ids, reply mask) per conversation, cut like the RM's pairs: prompt left, reply right;
    # the mask leaves out what a tool writes (nanochat's python_output parts)
    examples = []
    for prompt, reply, _ in conversations:
        r, mask = tok.render_reply(reply)
        p, r = cut_to_fit(tok.render_prompt(prompt), r, max_len, tok.bos_id)
        examples.append((p, r, mask[:len(r)]))
    print0(f"data: {len(examples)} conversations from {args.conversations}; {loader.steps_per_epoch} steps per epoch")

    model_bb.set_trainable("all")
    print0(compile_models(args.compile, env.device, model_bb))
    if args.activation_checkpointing:
        checkpoint_activations(model_bb.blocks)
    model = CompletionLogprobs(model_bb)
    dtype = compute_dtype(args.dtype, env.device)
    parallel = Parallel(args.parallel, env, dtype)
    ddp_model = parallel.wrap(model, model_bb.blocks)
    print0(parallel.describe(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer("adamw", model_bb.model, trainable, args.lr, args.weight_decay, env.device)
    source = str(resolve_model_path(args.backbone).resolve())

    def saving(step: int, into: Path, consolidate: bool) -> Saving:
        return Saving({"source": source},
                      lambda d, stamp, meta, state, weights: model_bb.save(d, stamp, meta, tok, state, weights))

    trainer = Trainer(args, env, parallel, model, optimizer, module=model_bb.model, kind="sft", out_dir=out_dir,
                      saving=saving)
    start_step = trainer.resume(resume, ("batch_size", "seed", "max_len"),
                                model_bb.restore)  # fp32 masters where the layout saved bf16
    if args.consolidate:
        return trainer.consolidate(resume)
    autocast = precision(dtype, env.device)

    trainer.start(log_dir, "sft")
    window = WindowSums(["loss", "tokens", "steps"])  # this rank's sums since the last log
    for step in range(start_step, args.max_steps):
        mine = [i for mb in loader.micro_batches(step) for i in mb]
        batch = make_sequences([examples[i][0] for i in mine], [examples[i][1] for i in mine], 1, tok.pad_id,
                               token_mask=[examples[i][2] for i in mine])
        lr = trainer.set_lr(step)
        done = step + 1
        with doing(f"a training micro-batch of {plan.device_batch_size} conversations",
                   (*smaller_micro(plan.device_batch_size, plan.per_rank), "--activation_checkpointing",
                    FEWER_RANKS_STATE)):
            stats = sft_backward(ddp_model, batch, plan.device_batch_size, env.device, autocast)
        with doing("the optimizer step", (FEWER_RANKS_STATE,)):
            guarded_step(optimizer, trainable, args.grad_clip, trainer.guard, done, stats[0].item())
        window.add(loss=stats[0].item(), tokens=stats[1].item(), steps=1)
        trainer.tracker.advance()
        if trainer.log_due(done):
            s = window.reduced()  # every rank's loss is its share of the global one; steps count once per rank
            trainer.log(done, {"train/loss": s["loss"] / (s["steps"] / env.world_size), "train/lr": lr,
                               "perf/tokens_per_s": s["tokens"] / trainer.elapsed()})
            window.zero()
        trainer.end_step(done)
    return trainer.finish()


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")

if __name__ == "__main__":
    sys.exit(main())
