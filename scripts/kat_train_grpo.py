"""GRPO: for each prompt the policy samples a group of G completions, a reward model and/or rule-based
reward functions score them, each completion's advantage is its reward relative to its group, and
the policy takes clipped-surrogate steps with a KL penalty to a frozen reference.

    python -m scripts.kat_train_grpo --policy SFT_CKPT --rm RM_DIR --prompts prompts.jsonl
    torchrun --standalone --nproc_per_node=8 -m scripts.kat_train_grpo -- --policy ... --prompts ...
    --reward_fn mypkg.rewards:exact_match   # f(prompt, completion, row) -> float, repeatable

The policy is saved as a nanochat checkpoint (or an HF dir) that loads again as --policy/--backbone.
The last line printed on success names the checkpoint written.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

from nanochat_ext.algorithms.evaluation import eval_decode_rows, evaluate_pass_k, evaluate_rewards
from nanochat_ext.algorithms.grpo import (IMPORTANCE_LEVELS, LOSS_AGGS, LOSS_STATS, SCALE_REWARDS, STD_MODES,
                                          TRL_LOSS_TYPES, LossConfig, group_advantages, policy_backward)
from nanochat_ext.algorithms.rewards import Rewards, check_references, check_rm_tokenizer
from nanochat_ext.algorithms.rollouts import Rollouts, grpo_window, log_rollouts, window_metrics
from nanochat_ext.cli import (MICRO_BATCH_HELP, MODEL_HELP, add_dashed_aliases, add_lora_args, add_output_args,
                              add_parallel_args, add_runtime_args, auto_micro_batch, check_consolidate, check_flags,
                              micro_batch, output_dirs, run_script, script_argv, steps_from_epochs)
from nanochat_ext.data.batching import BatchPlan, GlobalBatchLoader, encode_prompts
from nanochat_ext.data.rows import PromptRow, attach_density, load_density, load_prompts, split_by_prefix
from nanochat_ext.ddp_common import DistEnv, peak_memory_gb, print0, seed_everything
from nanochat_ext.errors import InputError
from nanochat_ext.generation.decode_cost import peak_bandwidth
from nanochat_ext.generation.engine import Engine, decode_compiled
from nanochat_ext.generation.sampling import SamplingConfig
from nanochat_ext.generation.tools import TOOLS, tool_tokens
from nanochat_ext.models.loader import load_reward_model
from nanochat_ext.models.lora import BEFORE_LORA, RESUME_KEYS, check_lora_args, dropout_active
from nanochat_ext.presets import PRESETS, apply_preset, preset_tag, print_preset
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.tokenizer import TokenizerWrapper
from nanochat_ext.training.logprobs import make_sequences, token_logprobs
from nanochat_ext.training.memory import (FEWER_RANKS_STATE, LORA_STATE, auto_pick, backbone_shape, describe, doing,
                                          grpo_memory, report_peak, smaller_micro)
from nanochat_ext.training.optim import LR_DECAYS, OPTIMIZERS, check_optimizer, guarded_step
from nanochat_ext.training.policy import PolicyTraining
from nanochat_ext.training.tracking import Tracker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kat_train_grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="chat_rl: nanochat's RL recipe (scripts/chat_rl.py) in one flag; every value it sets is "
                        "printed at start, and a flag given explicitly overrides it (README: nanochat's RL here)")
    g = p.add_argument_group("inputs")
    g.add_argument("--policy", required=True, help="the model to train: " + MODEL_HELP)
    g.add_argument("--tokenizer", default=None, help="default: found beside the policy, else $NANOCHAT_BASE_DIR/tokenizer")
    g.add_argument("--rm", default=None,
                   help="reward-model checkpoint file, or a dir (its newest complete checkpoint), as written by "
                        "kat_train_rm; optional when --reward_fn is given")
    g.add_argument("--rm_backbone", default=None,
                   help="the RM's backbone, where the RM cannot find it itself (it looks beside its own dir, under "
                        "$NANOCHAT_BASE_DIR, then at the absolute path it recorded); refused if its weights differ "
                        "from the ones the RM was trained on")
    g.add_argument("--prompts", required=True,
                   help="{prompt: str | [messages], answer?, prefix_id?} as JSONL, parquet, Arrow or a datasets "
                        "save_to_disk dir; a pairs file works too (its prompts); "
                        "formats: README.md, \"Data formats\"")
    g.add_argument("--eval_prompts", default=None,
                   help="held-out prompts for --eval_every (default: --val_ratio of --prompts, split by prefix_id)")
    g.add_argument("--density", default=None,
                   help="per-prompt density weights (as for kat_train_rm): scale each prompt's share of the loss")
    g.add_argument("--reward_fn", action="append", default=[],
                   help="rule-based reward 'module:function', called f(prompt, completion, row) -> float, or a "
                        "built-in: gsm8k, gsm8k_numeric, exact_match, contains_answer; repeatable")
    g.add_argument("--reward_workers", type=int, default=1,
                   help="threads calling each per-completion --reward_fn (a judge or sandbox that waits on I/O); a "
                        "function with `batched = True` is called once per step with lists instead (default: 1)")
    g.add_argument("--reward_url", default=None,
                   help="a reward service: each rank POSTs its completions of a step as JSON {prompts, completions, "
                        "rows} and reads {rewards: [...]} back; one more reward column, 'url'")
    g.add_argument("--reward_timeout", type=float, default=60.0,
                   help="seconds per --reward_url call, tried 3 times (default: %(default)s)")
    g.add_argument("--reward_clip", type=float, default=None,
                   help="refuse (stop the run with the prompt named) a reward function value outside [-C, C]; "
                        "NaN/inf and non-numbers are always refused")
    g.add_argument("--reward_weights", type=float, nargs="+", default=None,
                   help="one weight per reward, in order: the RM (if --rm) then each --reward_fn (default: all 1)")
    g = p.add_argument_group("rollouts")
    g.add_argument("--batch_size", type=int, default=8, help="GLOBAL prompts per step (default: %(default)s)")
    g.add_argument("--group_size", type=int, default=8, help="completions per prompt, G >= 2 (default: %(default)s)")
    g.add_argument("--max_new_tokens", type=int, default=64, help="completion length limit (default: %(default)s)")
    g.add_argument("--min_new_tokens", type=int, default=0, help="every stop token is held back until this many tokens")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; the ratio, KL and entropy use the same softmax(logits / T) "
                        "(default: %(default)s)")
    g.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--tools", choices=TOOLS, default=None,
                   help="calculator: run nanochat's calculator inside the rollouts (a <|python_start|>expr<|python_end|> "
                        "block gets its answer forced in, masked out of the loss), as nanochat's Engine does; "
                        "default: calculator where the tokenizer has nanochat's python tokens, else none")
    g.add_argument("--mask_truncated", action="store_true",
                   help="leave completions that hit --max_new_tokens out of the loss")
    g.add_argument("--filter_zero_std", action="store_true",
                   help="DAPO's dynamic sampling: drop groups whose rewards are all equal (zero advantage, no "
                        "signal) and draw more prompts until the global batch has --batch_size groups that differ")
    g.add_argument("--max_draws", type=int, default=4,
                   help="with --filter_zero_std, prompt batches drawn per step at most; a batch still short after "
                        "them is topped up with zero-spread groups, logged as train/filled_frac (default: %(default)s)")
    g.add_argument("--overlong_buffer", type=int, default=0,
                   help="DAPO's soft overlong penalty: a completion longer than max_new_tokens - N tokens gets "
                        "-penalty x (length - (max_new_tokens - N)) / N added to its reward (0: off)")
    g.add_argument("--overlong_penalty", type=float, default=1.0,
                   help="the penalty at max_new_tokens, with --overlong_buffer (default: %(default)s)")
    g = p.add_argument_group("loss")
    g.add_argument("--scale_rewards", choices=SCALE_REWARDS, default="group",
                   help="advantage = (r - group mean) / std of the group, of the batch, or unscaled (default: group)")
    g.add_argument("--std_mode", choices=STD_MODES, default="sample",
                   help="std for --scale_rewards: sample (divide by n - 1, as TRL and torch.std do, so a TRL config "
                        "means the same lr and beta here) or population (divide by n: at G=2 advantages 1.41x "
                        "larger) (default: %(default)s)")
    g.add_argument("--loss_agg", choices=LOSS_AGGS, default="token",
                   help="with l_it the loss of token t of completion i (mask m_it) over the global batch: "
                        "token: sum_it l_it / sum_it m_it (DAPO); sequence: mean_i (sum_t l_it / sum_t m_it) "
                        "(GRPO paper); dr_grpo: sum_it l_it / (completions x max_new_tokens) (default: token)")
    g.add_argument("--loss_type", choices=list(TRL_LOSS_TYPES), default=None,
                   help="TRL's name for --loss_agg: dapo = token, grpo = sequence, dr_grpo = dr_grpo, bnpo = token "
                        "(TRL's bnpo normalises each micro-batch by its own tokens; here the global batch's)")
    g.add_argument("--importance_level", choices=IMPORTANCE_LEVELS, default="token",
                   help="token: ratio r_it = pi(y_it) / pi_old(y_it) per token (GRPO); sequence: GSPO's "
                        "s_i = exp(mean_t log r_it) for every token of completion i, clipped per completion. The "
                        "GSPO paper pairs it with --loss_agg sequence; token sums weight a completion by its length")
    g.add_argument("--clip_eps", type=float, default=0.2, help="PPO clip range (default: %(default)s)")
    g.add_argument("--clip_eps_high", type=float, default=None, help="upper clip range (DAPO's clip-higher); default: clip_eps")
    g.add_argument("--beta", type=float, default=0.04,
                   help="weight of the k3 KL to the frozen reference; 0 skips the reference model (default: %(default)s)")
    g.add_argument("--num_iterations", type=int, default=1, help="optimizer updates per rollout batch, mu (default: 1)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--device_batch_size", type=micro_batch, default=None, help="sequences " + MICRO_BATCH_HELP)
    g.add_argument("--max_steps", type=int, default=None, help="rollout steps (default: --num_epochs's, else 100)")
    g.add_argument("--num_epochs", type=int, help="--max_steps, where not given: train prompts // --batch_size x E "
                                                   "(steps' worth of batches: dynamic sampling may draw more)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw; or muon, nanochat's own optimizer (MuonAdamW) for nanochat policies: its Muon on "
                        "the block matrices, AdamW on embeddings, LM head and scalars, each group at the learning "
                        "rate nanochat's chat_rl.py gives it; --weight_decay is then the matrices' (default: adamw)")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (adamw; default 1e-5); with --optimizer muon the fraction of nanochat's "
                        "learning rates, its chat_rl.py --init-lr-frac (default 0.05)")
    g.add_argument("--warmup_steps", type=int, default=0)
    g.add_argument("--lr_decay", choices=LR_DECAYS, default="cosine",
                   help="after the warmup: cosine to 0.1x, or linear to 0 as nanochat's chat_rl (default: cosine)")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global grad norm (0: off)")
    g.add_argument("--seed", type=int, default=0, help="data order and sampling (default: %(default)s)")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--val_ratio", type=float, default=0.1, help="share of prompts held out when no --eval_prompts")
    g.add_argument("--eval_every", type=int, default=0, help="evaluate every N steps and at the end (0: only at the end)")
    g.add_argument("--eval_examples", type=int, default=0, help="evaluate on the first N eval prompts (0: all)")
    g.add_argument("--eval_pass_k", type=int, default=0,
                   help="also pass@1..K at each evaluation: K samples per eval prompt at temperature 1, correct where "
                        "the first --reward_fn (e.g. gsm8k) gives 1, as nanochat's chat_rl; beside it the unbiased "
                        "estimator (Chen et al. 2021) (0: off)")
    g.add_argument("--log_every", type=int, default=1, help="log train metrics every N steps")
    g.add_argument("--log_rollouts", action="store_true",
                   help="write every completion (token ids, text, reward) of every step to <log_dir>/rollouts.jsonl, "
                        "in global prompt order whatever the world size")
    add_output_args(p, "chatrl_checkpoints")
    add_parallel_args(p)
    add_lora_args(p)
    add_runtime_args(p)
    add_dashed_aliases(p)
    argv = script_argv(argv)
    args = p.parse_args(argv)
    apply_preset(p, argv, args)
    if args.loss_type:
        args.loss_agg = TRL_LOSS_TYPES[args.loss_type]
    if args.lr is None:
        args.lr = 0.05 if args.optimizer == "muon" else 1e-5
    return args


def train(args: argparse.Namespace, env: DistEnv) -> Path:
    seed_everything(args.seed)
    print_preset(args)
    G = args.group_size

    # ---- validate every input before anything is trained or written ---------------------------
    check_flags(args, GRPO_RANGES)
    check_consolidate(args)
    lora = check_lora_args(args)
    check_optimizer(args.optimizer, bool(lora), args.parallel)
    prompts = load_prompts(args.prompts)
    if args.density:
        attach_density(prompts, load_density(args.density), args.density)
    if args.eval_prompts:
        train_rows, eval_rows = prompts, load_prompts(args.eval_prompts)
    else:
        train_rows, eval_rows = split_by_prefix(prompts, args.val_ratio)
    eval_rows = eval_rows[:args.eval_examples or None]
    steps_from_epochs(args, len(train_rows), args.batch_size)
    check_references(args.reward_fn, train_rows, args.prompts)  # every row a built-in reward scores has its answer
    check_references(args.reward_fn, eval_rows, args.eval_prompts or args.prompts)
    plan = BatchPlan.make(args.batch_size, env.world_size, None)
    seqs_per_rank = plan.per_rank * G
    auto = auto_micro_batch(args, env.device)
    micro = seqs_per_rank if auto else args.device_batch_size or seqs_per_rank
    if seqs_per_rank % micro:
        raise InputError(f"each rank has {plan.per_rank} prompts x {G} = {seqs_per_rank} sequences per step, "
                         f"which --device_batch_size {micro} does not divide")
    loader = GlobalBatchLoader(len(train_rows), plan, env.rank, args.seed)
    training = PolicyTraining(args, env, lora)
    policy, tok = training.policy, training.tok
    out_dir, log_dir = output_dirs(args, "chatrl_checkpoints", preset_tag(args, len(policy.blocks)))
    resume = resolve_resume(args.resume, out_dir, "grpo_policy")
    rm = None
    if args.rm:
        rm = load_reward_model(args.rm, env.device, backbone=args.rm_backbone)
        check_rm_tokenizer(rm, tok, args.rm)
    if args.overlong_buffer < 0 or args.overlong_buffer > args.max_new_tokens:
        raise InputError(f"--overlong_buffer must be 0..--max_new_tokens ({args.max_new_tokens}), got {args.overlong_buffer}")
    overlong = (args.max_new_tokens, args.overlong_buffer, args.overlong_penalty) if args.overlong_buffer else None
    rewards = Rewards(rm, args.reward_fn, args.reward_weights, overlong, args.reward_clip, args.reward_workers,
                      args.reward_url, args.reward_timeout)
    if args.eval_pass_k:
        rewards.task_column()
    tools = tool_tokens(args.tools, tok)
    args.tools = "calculator" if tools else "none"  # resolved, so that a resume compares what the run did
    prompt_ids = encode_prompts(train_rows, tok, policy.max_seq_len, args.max_new_tokens, args.prompts)
    eval_ids = encode_prompts(eval_rows, tok, policy.max_seq_len, args.max_new_tokens,
                              args.eval_prompts or args.prompts)
    claim_out_dir(out_dir, log_dir)

    compile_decode, why = decode_compiled(args.compile, env.device, args.max_steps, args.max_new_tokens)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.min_new_tokens)
    loss_cfg = LossConfig(args.loss_agg, args.clip_eps, args.clip_eps_high, args.beta, args.max_new_tokens,
                          args.importance_level)
    print0(f"data: {len(train_rows)} train / {len(eval_rows)} eval prompts; {loader.steps_per_epoch} steps per epoch")
    print0(tok.describe_stops())

    # ---- models, optimizer, resume ----------------------------------------------------------------
    model = training.build(args.beta > 0, args.temperature, (rm.model.backbone,) if rm else ())
    reference, parallel, dtype, autocast = training.reference, training.parallel, training.dtype, training.autocast
    # The engine copies the policy before it is sharded (under fsdp it decodes from a whole copy)
    engine = Engine(policy, compile=compile_decode,
                    whole_in=(parallel.gathers_in or torch.float32) if parallel.sharded else None, tools=tools,
                    reserve=max(map(len, prompt_ids + eval_ids)) + args.max_new_tokens)
    training.wrap()
    ddp_model, trainable, optimizer = training.ddp_model, training.trainable, training.optimizer
    window = grpo_window(rewards.names)
    rollouts = Rollouts(engine, rewards, loader, train_rows, prompt_ids, tok, sampling, args, env, autocast, window)
    trainer = training.trainer(out_dir, "grpo_policy", resume,
                               RESUME_FLAGS + (("max_draws",) if args.filter_zero_std else ()),
                               {**PRE_DAPO_DEFAULTS, **BEFORE_LORA})
    if resume is not None:
        rollouts.drawn = int(resume[2].get("draw", resume[2]["step"]))  # before dynamic sampling: one draw a step
    training.state.update(draw=rollouts.drawn, device_batch_size=micro)  # what a save before any step records
    print0(training.describe())
    peak_bw = peak_bandwidth(env.device)
    copy = ("a whole copy gathered from the shards per rollout" if parallel.sharded else
            "a bf16 copy of the matmul weights, refreshed per rollout" if dtype == torch.bfloat16 else "")
    print0(f"decode: {'compiled' if engine.compiled else 'eager'} "
           f"({why if policy.native else 'a transformers model decodes eagerly'})" + (f"; from {copy}" if copy else "")
           + f"; tools: {'calculator' if tools else 'none'}")
    if args.consolidate:
        return trainer.consolidate(resume)

    # ---- train ------------------------------------------------------------------------------------
    rm_model = getattr(rm, "model", None)
    policy_shape = backbone_shape(policy)
    rm_shape = backbone_shape(rm_model.backbone) if hasattr(rm_model, "backbone") else None

    # A compiled engine keeps a decode state per row count it decodes: the rollouts' and the evaluation calls'.
    kept_rows = tuple(sorted({seqs_per_rank, *eval_decode_rows(len(eval_ids), env.world_size, seqs_per_rank,
                                                              args.eval_pass_k)})) if engine.compiled else ()

    estimate_for = functools.partial(
        grpo_memory, policy_shape, parallel=args.parallel, ranks=env.world_size,
        checkpointing=args.activation_checkpointing, prompt_len=max(map(len, prompt_ids)),
        new_tokens=args.max_new_tokens, rows=seqs_per_rank,  # at the longest prompt, every completion at its longest
        accum=None if getattr(model, "accumulate_unsharded", True) else 1, reference=reference is not None,
        rm=rm_shape, lora=sum(p.numel() for p in trainable) if lora else 0, device=env.device.type,
        kept_rows=kept_rows, slots=engine.reserved_slots)

    if auto:
        micro, line = auto_pick(seqs_per_rank, estimate_for, env.device, resume, prefer=G)
        print0(line)
    training.state["device_batch_size"] = micro
    # A group's prompt can be computed once for its G completions (PrefixTree rows) when micro-batches hold
    # whole groups; the model does so where that is cheaper. Same log-probs as one row per completion.
    share_prompt = micro % G == 0
    print0(f"batch: {args.batch_size} prompts x {G} completions global = {env.world_size} ranks x "
           f"{seqs_per_rank} sequences in micro-batches of {micro}; rewards: {', '.join(rewards.names)}")
    estimate = estimate_for(micro=micro)
    print0(describe(estimate, micro))
    trainer.start(log_dir, "grpo")
    for step in range(trainer.start_step, args.max_steps):
        ro = rollouts.next()
        training.state["draw"] = rollouts.drawn
        done = step + 1
        total = rewards.total(ro.rewards)
        if args.log_rollouts:
            log_rollouts(trainer.tracker, done, ro, total, tok)
        batch = make_sequences([prompt_ids[i] for i in ro.indices], ro.completions, G, tok.pad_id, share_prompt,
                               ro.sampled)
        batch["advantages"] = group_advantages(total, G, args.scale_rewards, args.std_mode)
        batch["weights"] = torch.tensor([train_rows[i].weight for i in ro.indices],
                                        dtype=torch.float32).repeat_interleave(G)
        if args.mask_truncated:
            batch["mask"][torch.tensor(ro.truncated)] = 0.0
        t0 = time.time()
        with doing(f"log-probs without gradients, {micro} sequences at a time", smaller_micro(micro, seqs_per_rank)):
            if reference is not None:  # pi_old: the first update's own log-probs (policy_backward)
                batch["ref_logp"] = token_logprobs(reference, batch, micro, env.device, autocast)
        t1 = time.time()
        lr = trainer.set_lr(step)  # adamw: the lr; muon: the LM head's (its first group)
        stats = torch.zeros(len(LOSS_STATS), dtype=torch.float64)
        for iteration in range(args.num_iterations):
            with doing(f"a training micro-batch of {micro} sequences",
                       (*smaller_micro(micro, seqs_per_rank), "--activation_checkpointing", FEWER_RANKS_STATE,
                        LORA_STATE)), dropout_active(policy):
                it = policy_backward(ddp_model, batch, micro, loss_cfg, env.device, autocast,
                                     keep_old=iteration == 0 and args.num_iterations > 1)
            with doing("the optimizer step", (FEWER_RANKS_STATE, LORA_STATE)):
                grad_norm = guarded_step(optimizer, trainable, args.grad_clip, trainer.guard, done, it[0].item())
            stats += it
        window.add(**dict(zip(LOSS_STATS, (stats / args.num_iterations).tolist())), ref_s=t1 - t0,
                   train_s=time.time() - t1, steps=1)
        trainer.tracker.advance()
        if trainer.log_due(done):
            metrics = window_metrics(window.reduced(), rewards.names, env.world_size, lr, grad_norm,
                                     trainer.elapsed(), peak_bw)
            trainer.log(done, {**metrics, **peak_memory_gb(env.device)})
            window.zero()
        if trainer.eval_due(done):
            with trainer.evaluating(done, f"the evaluation ({seqs_per_rank} completions of up to "
                                    f"{args.max_new_tokens} tokens at a time)",
                                    ("fewer completions per rank (--batch_size, --group_size, or more ranks)",
                                     "a smaller --max_new_tokens")):
                ev = evaluate(engine, eval_rows, eval_ids, rewards, tok, sampling, args, env, autocast, seqs_per_rank,
                              trainer.tracker, done) if eval_rows else {}
            trainer.evaluated(done, ev)
        trainer.end_step(done)
    report_peak(env.device, estimate)
    return trainer.finish()


def evaluate(engine: Engine, rows: list[PromptRow], prompt_ids: list[list[int]], rewards: Rewards,
             tok: TokenizerWrapper, sampling: SamplingConfig, args: argparse.Namespace, env: DistEnv, autocast,
             max_rows: int, tracker: Tracker, step: int) -> dict:
    """Collective: the held-out rewards (evaluate_rewards) and, with --eval_pass_k, pass@k, decoding at most a
    rollout's rows (max_rows) at a time; rank 0 shows its first greedy completions."""
    metrics, shown = evaluate_rewards(engine, rows, prompt_ids, rewards, tok, sampling, args.seed, env, autocast,
                                      max_rows)
    for i, (prompt, completion) in enumerate(shown):
        tracker.text(step, f"eval/sample_{i}", f"**prompt:** {prompt}\n\n**completion:** {completion}")
    if args.eval_pass_k:
        metrics.update(evaluate_pass_k(engine, rows, prompt_ids, rewards, tok, sampling, args.eval_pass_k, args.seed,
                                       env, autocast, max_rows))
    return metrics


# The flags a resumed run must keep (its learning-rate schedule too, unless --resume_extend).
RESUME_FLAGS = ("batch_size", "group_size", "seed", "loss_agg", "max_new_tokens", "std_mode", "importance_level",
                "filter_zero_std", "optimizer", "tools", *RESUME_KEYS)


GRPO_RANGES = {
    "group_size": (lambda v: v >= 2, ">= 2 (advantages are relative to the group)"),
    "temperature": (lambda v: v > 0 and v != float("inf"), "> 0 for training (log-probs are taken at it)"),
    "top_k": (lambda v: v >= 0, ">= 0 (0: off)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "min_new_tokens": (lambda v: v >= 0, ">= 0"),
    "num_iterations": (lambda v: v >= 1, ">= 1"),
    "max_draws": (lambda v: v >= 1, ">= 1"),
    "clip_eps": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "clip_eps_high": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "beta": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "overlong_penalty": (lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "reward_clip": (lambda v: 0 < v < float("inf"), "a finite number > 0"),
    "reward_workers": (lambda v: v >= 1, ">= 1"),
    "eval_pass_k": (lambda v: v >= 0, ">= 0 (0: off)"),
    "eval_examples": (lambda v: v >= 0, ">= 0 (0: all)"),
    "reward_timeout": (lambda v: 0 < v < float("inf"), "a finite number > 0"),
}

# What a checkpoint written before these flags existed was trained with.
PRE_DAPO_DEFAULTS = {"std_mode": "population", "importance_level": "token", "filter_zero_std": False,
                     "optimizer": "adamw", "tools": "none"}


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")

if __name__ == "__main__":
    sys.exit(main())
