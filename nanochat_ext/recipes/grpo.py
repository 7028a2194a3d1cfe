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
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.evaluation import EvalConfig, eval_decode_rows
from nanochat_ext.algorithms.grpo import GRPO, PRE_DAPO_DEFAULTS, RESUME_FLAGS, SPEC, Prompts
from nanochat_ext.algorithms.grpo_config import TRL_LOSS_TYPES, GRPOConfig
from nanochat_ext.algorithms.rewards import RewardConfig, check_references, check_reward_fns, make_rewards
from nanochat_ext.algorithms.rollouts import DecodeSpec, RolloutConfig, RolloutEngines
from nanochat_ext.algorithms.trainers import WRITERS
from nanochat_ext.cli import (
    Configs,
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
from nanochat_ext.data.batching import BatchPlan, GlobalBatchLoader, encode_prompts
from nanochat_ext.data.rows import read_prompts
from nanochat_ext.ddp_common import print0, seed_everything
from nanochat_ext.engine.cost import decode_compiled
from nanochat_ext.engine.engine import Engine
from nanochat_ext.errors import InputError
from nanochat_ext.models.backbone import Backbone
from nanochat_ext.models.lora import BEFORE_LORA, RESUME_KEYS
from nanochat_ext.presets import PRESET_HELP, PRESETS, apply_preset, preset_tag, print_preset
from nanochat_ext.runtime.checkpoint import read_json
from nanochat_ext.runtime.outdir import claim_out_dir
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.runtime.session import Session
from nanochat_ext.training.logprobs import reference_model
from nanochat_ext.training.loop import Loop
from nanochat_ext.training.memory import StepMemory, backbone_shape, grpo_memory, micro_batch_for
from nanochat_ext.training.setup import Checks, PolicyTraining, load_policy, load_teacher


def flags() -> argparse.ArgumentParser:
    p, g = trainer_parser(SPEC.name, __doc__)
    p.add_argument("--preset", choices=list(PRESETS), default=None, help=PRESET_HELP)
    g.add_argument("--prompts", required=True,
                   help="{prompt: str | [messages], answer?, prefix_id?} as JSONL, parquet, Arrow or a datasets "
                        "save_to_disk dir; a pairs file works too (its prompts); formats: docs/data.md")
    g.add_argument("--teacher", default=None,
                   help="--advantage distill: the frozen model the policy learns from, scoring each token the policy "
                        "samples; any size, the policy's tokenizer (a nanochat checkpoint or a local HF dir)")
    add_config(p, RewardConfig, SPEC.name, "rewards")
    add_config(p, RolloutConfig, SPEC.name, "rollouts")
    add_config(p, AgentConfig, SPEC.name, "tools and environments")
    add_config(p, GRPOConfig, SPEC.name, "loss")
    add_config(p, EvalConfig, SPEC.name, "evaluation")
    add_training(p, SPEC.name, lora=True)
    p.resolve = resolve  # the run's options resolved as the command line's and the API's alike
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run the command line asks for."""
    return command_line_run(flags(), argv)


def resolve(options: dict, given: set[str]) -> None:
    """What depends on other options: --preset's values where not given, TRL's --loss_type as --loss_agg."""
    apply_preset(options, given)
    if options["loss_type"]:
        options["loss_agg"] = TRL_LOSS_TYPES[options["loss_type"]]


def train(args: RunConfig, session: Session) -> Path:
    env, c = session.env, configs(args, SPEC.name)
    seed_everything(args.seed)
    print_preset(args.preset, args.preset_values)
    grpo, rollout, evaluation = config(GRPOConfig, args), config(RolloutConfig, args), config(EvalConfig, args)
    reward, agent_cfg = config(RewardConfig, args), config(AgentConfig, args)

    # ---- inputs, checked before anything is trained or written --------------------------------------------
    train_rows, eval_rows = read_prompts(args.prompts, c.data.density, c.data.val_ratio, evaluation.eval_prompts,
                                         evaluation.eval_examples)
    loop_cfg = c.loop.with_steps(len(train_rows), c.batch.batch_size, "prompts")
    check_reward_fns(reward.reward_fn or [], train_rows, args.prompts)  # callable as rewards; the answers there
    check_references(reward.reward_fn or [], eval_rows, evaluation.eval_prompts or args.prompts)
    plan = BatchPlan.make(c.batch.batch_size, env.world_size, None)
    share = plan.per_rank * rollout.group_size  # this rank's sequences a step
    given_micro = c.batch.device_batch_size if c.batch.device_batch_size != "auto" else None
    if share % (given_micro or share):
        raise InputError(f"each rank has {plan.per_rank} prompts x {rollout.group_size} = {share} sequences per step, "
                         f"which --device_batch_size {given_micro} does not divide")
    loader = GlobalBatchLoader(len(train_rows), plan, env.rank, c.batch.seed)
    grpo.check(rollout.filter_zero_std)
    if (grpo.advantage == "distill") != bool(args.teacher):
        raise InputError("--advantage distill needs a --teacher" if args.teacher is None else
                         "--teacher is read by --advantage distill alone")
    loaded = load_policy(args.policy, c.model, env, c.lora.spec, c.optim.optimizer)
    tok = loaded.tok
    teacher = load_teacher(args.teacher, tok, env) if args.teacher else None
    out_dir, log_dir = c.out.dirs(SPEC.words["stage_dir"], preset_tag(args.preset, len(loaded.backbone.blocks))
                                or ("density" if c.data.density else "uniform"))
    resume = resolve_resume(c.out.resume, out_dir, SPEC, WRITERS)
    agent = Agent(agent_cfg, tok, train_rows[0].row)
    agent_cfg = dataclasses.replace(agent_cfg, tools=agent.spec)  # a resume compares what it did
    rewards = make_rewards(reward, tok, env.device, rollout.overlong(), bool(evaluation.eval_pass_k), agent.env_reward,
                           optional=teacher is not None)
    if not rewards.names and rollout.filter_zero_std:
        raise InputError("--filter_zero_std keeps the groups whose rewards differ, and a distillation without a reward "
                         "has none: leave it off, or give a reward")
    context = loaded.backbone.max_seq_len
    train_ids = encode_prompts(train_rows, agent.render_prompt, context, rollout.max_new_tokens, args.prompts)
    eval_ids = encode_prompts(eval_rows, agent.render_prompt, context, rollout.max_new_tokens,
                              evaluation.eval_prompts or args.prompts)
    claim_out_dir(out_dir, log_dir)
    print0(f"data: {len(train_rows)} train / {len(eval_rows)} eval prompts; {loader.steps_per_epoch} steps per epoch")
    print0(tok.describe_stops())

    # ---- the model, its engine, resume ----------------------------------------------------------------------
    flags = {**recorded(args, c.optim, loop_cfg, c.lora, rollout, agent_cfg),
             "kl_in_reward": grpo.kl_in_reward and grpo.beta > 0}
    check_kl_place(resume, flags["kl_in_reward"], grpo)
    compile_decode, why = decode_compiled(c.model.compile, env.device, loop_cfg.max_steps, rollout.max_new_tokens)
    rm_backbone = getattr(getattr(rewards.rm, "model", None), "backbone", None)
    training = PolicyTraining(
        loaded, c.model, c.optim, env, spec=SPEC, reference=grpo.uses_reference, resume=resume,
        checks=Checks(flags, RESUME_FLAGS + RESUME_KEYS + (("max_draws",) if rollout.filter_zero_std else ()),
                      {**PRE_DAPO_DEFAULTS, **BEFORE_LORA}),
        merge_lora=c.lora.merge_lora, temperature=rollout.temperature,
        also_compile=(rm_backbone,) if rm_backbone else (),
        from_whole=DecodeSpec(compile_decode, agent, max(map(len, train_ids + eval_ids)) + rollout.max_new_tokens,
                              rollout_copy=bool(rollout.async_rollouts)).engines)
    engines: RolloutEngines = training.made_from_whole
    print0(training.describe())
    print0(decode_line(training, engines.engine, why))
    print0(agent.describe())
    loop = Loop(training, loop_cfg, c.out, c.optim, out_dir, log_dir, flags, session)
    if c.out.consolidate:
        return loop.consolidate(resume)

    # ---- micro-batches by memory, the method, the loop -------------------------------------------------------
    estimate_for = memory_model(training, engines, c, share, rollout.max_new_tokens, train_ids, eval_ids,
                                evaluation.eval_pass_k, rm_backbone, teacher)
    micro, estimate = micro_batch_for(c.batch.device_batch_size, share, estimate_for, env.device, resume,
                                      prefer=rollout.group_size)
    print0(f"batch: {c.batch.batch_size} prompts x {rollout.group_size} completions global = {env.world_size} ranks x "
           f"{share} sequences in micro-batches of {micro}; rewards: {', '.join(rewards.names)}")
    method = GRPO(training, grpo, rollout, evaluation, rewards, Prompts(train_rows, train_ids),
                  Prompts(eval_rows, eval_ids), loader, c.batch.seed, micro, estimate, session.progress, engines,
                  reference_model(teacher, training.dtype, temperature=rollout.temperature) if teacher else None)
    try:
        return loop.run(method)
    finally:
        method.close()  # the rollout thread, where --async_rollouts runs one


def memory_model(training: PolicyTraining, engines: RolloutEngines, c: Configs, share: int, new_tokens: int,
                 train_ids: list[list[int]], eval_ids: list[list[int]], pass_k: int, rm_backbone: Backbone | None,
                 teacher: Backbone | None = None) -> Callable[..., StepMemory]:
    """What a GRPO step of this run holds on each rank, by micro-batch size (memory.grpo_memory): at the longest
    prompt, every completion at its longest; a compiled engine's decode state kept for each row count it decodes or
    compacts into."""
    engine, env = engines.engine, training.env
    kept_rows = engine.kept_rows({share, *eval_decode_rows(len(eval_ids), env.world_size, share, pass_k)})
    return functools.partial(
        grpo_memory, backbone_shape(training.policy), parallel=c.model.parallel, ranks=env.world_size,
        checkpointing=c.model.activation_checkpointing, prompt_len=max(map(len, train_ids)), new_tokens=new_tokens,
        rows=share, accum=None if getattr(training.model, "accumulate_unsharded", True) else 1,
        reference=training.reference is not None, rm=backbone_shape(rm_backbone) if rm_backbone else None,
        lora=sum(p.numel() for p in training.trainable) if c.lora.lora_r else 0, device=env.device.type,
        kept_rows=kept_rows, slots=engine.reserved_slots, teacher=backbone_shape(teacher) if teacher else None,
        rollout_copy=engines.ahead.kept_bytes() if engines.ahead else 0)


def decode_line(training: PolicyTraining, engine: Engine, why: str) -> str:
    """The log line of how the engine decodes, and from what copy of the weights."""
    copy = ("a whole copy gathered from the shards per rollout" if training.parallel.sharded else
            "a bf16 copy of the matmul weights, refreshed per rollout" if training.dtype == torch.bfloat16 else "")
    return (f"decode: {'compiled' if engine.compiled else 'eager'} "
            f"({why if training.policy.native else 'a transformers model decodes eagerly'})"
            + (f"; from {copy}" if copy else ""))


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), train, "checkpoint")


def check_kl_place(resume: tuple | None, kl_in_reward: bool, grpo: GRPOConfig) -> None:
    """A run resumes with its KL where it started: --advantage rloo's moved from the loss to the reward (as TRL's
    RLOOTrainer) in an earlier version, and a checkpoint written before records no kl_in_reward (REINFORCE++'s was
    always in the reward)."""
    if resume is None:
        return
    was = read_json(resume[1]).get("args", {}).get("kl_in_reward",
                                                   grpo.advantage.startswith("reinforce_pp") and grpo.beta > 0)
    if was != kl_in_reward:
        raise InputError(f"--advantage {grpo.advantage} --beta {grpo.beta:g} weighs a KL in the "
                         f"{'reward' if kl_in_reward else 'loss'} (as TRL's RLOOTrainer), and the "
                         f"checkpoint was trained with it in the {'reward' if was else 'loss'}: start a new run, or "
                         f"resume it with the code that started it", path=str(resume[1]))
