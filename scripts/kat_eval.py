"""Evaluation stage: writes $NANOCHAT_BASE_DIR/report.md (+ report.json and one PNG per training stage).

- Each reward model: held-out pair accuracy and mean margin, overall, per topic, and for dense vs
  rare topics (when pairs carry a "topic" field; dense = at least an equal share of the pairs).
- The policy before and after GRPO on held-out prompts: mean RM score, task accuracy by ground truth
  (demo prompts carry a "topic", judged by nanochat_ext.tasks.synthetic.judge; dense minus rare topics),
  diversity (distinct-1/2 within each prompt's samples, bigram entropy over all samples), reward
  hacking (the share of a prompt's samples equal to its most common one, the share of all samples
  equal to the most common completion), completion length; one greedy completion and --samples
  sampled ones per prompt.
- Wall time per stage (from timings.tsv, written by speedrun.sh) and training curves.

    python -m scripts.kat_eval
    torchrun --standalone --nproc_per_node=2 -m scripts.kat_eval -- --policy_after .../chatrl_checkpoints/uniform
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.evaluation import evaluate_pass_k, evaluate_tool_use
from nanochat_ext.algorithms.rewards import Rewards, check_references
from nanochat_ext.cli import add_config, config, parse, parser, run_script
from nanochat_ext.data.batching import encode_prompts, truncate
from nanochat_ext.data.rows import is_val_prefix, load_pairs, load_prompts
from nanochat_ext.ddp_common import DistEnv, gather_objects, print0
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig, sample_seed
from nanochat_ext.errors import InputError
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.models.reward_model import RewardScorer, load_reward_model
from nanochat_ext.runtime.checkpoint import base_dir, find_checkpoint, resolve_model_path
from nanochat_ext.runtime.precision import compute_dtype, precision
from nanochat_ext.runtime.session import Session, SessionConfig
from nanochat_ext.tasks.report import all_judgeable, eval_rm, fmt, plot_curves, policy_measures, topics_of, write_report
from nanochat_ext.training.setup import ModelConfig
from scripts.flags import add_flag

BEFORE = "before (SFT)"  # the report's name for --policy_before, by default


def flags() -> argparse.ArgumentParser:
    p = parser("kat_eval", __doc__)
    add_flag(p, "kat_eval", "base_dir")
    add_flag(p, "kat_eval", "rm", nargs="*")
    p.add_argument("--score_rm", default=None,
                   help="the RM whose score is reported for the policies (default: <base>/rm_checkpoints/uniform)")
    add_flag(p, "kat_eval", "rm_backbone")
    p.add_argument("--policy_before", default=None,
                   help="the policy before training (default: <base>/chatsft_checkpoints/default)")
    p.add_argument("--before_name", default=BEFORE, help="its name in the report (default: %(default)s)")
    p.add_argument("--policy_after", default=None,
                   help="default: <base>/chatrl_checkpoints/uniform; not used when --policy is given")
    add_flag(p, "kat_eval", "policy", action="append", metavar="NAME=PATH")
    p.add_argument("--eval_pairs", default=None, help="held-out pairs (default: <base>/demo/eval_pairs.jsonl)")
    p.add_argument("--eval_holdout", type=float, default=None, metavar="RATIO",
                   help="evaluate only the prompts (by prefix_id) a trainer with --val_ratio RATIO holds out, so that "
                        "--eval_pairs and --eval_prompts may be the training files; the report says so")
    p.add_argument("--eval_prompts", default=None, help="held-out prompts (default: <base>/demo/eval_prompts.jsonl)")
    add_flag(p, "kat_eval", "samples")
    add_flag(p, "kat_eval", "temperature")
    add_flag(p, "kat_eval", "max_new_tokens")
    add_flag(p, "kat_eval", "seed")
    p.add_argument("--pass_k", type=int, default=0,
                   help="pass@1..K of each policy: K samples per prompt at temperature 1, correct where the first "
                        "--reward_fn gives 1 (nanochat's chat_rl measure), and the unbiased estimator (0: off)")
    add_flag(p, "kat_eval", "reward_fn")
    p.add_argument("--tool_prompts", default=None,
                   help="prompts with answers to measure tool use on: the task reward's greedy accuracy with the "
                        "tools and with them switched off (the same prompts, calls unanswered), calls and refusals, "
                        "pass@k "
                        "(default: <base>/demo/eval_arithmetic.jsonl where it exists)")
    p.add_argument("--tool_max_new_tokens", type=int, default=48,
                   help="completion length for --tool_prompts (default: %(default)s)")
    add_flag(p, "kat_eval", "out")
    add_config(p, AgentConfig, None, "tools and environments (--tool_prompts measures tool use)")
    add_config(p, ModelConfig, None, "model", only=("nanochat_vintage", "dtype", "compile"))
    add_config(p, SessionConfig, None, "runtime")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the defaults under --base_dir filled in."""
    p = flags()
    args = parse(p, argv)
    if args.pass_k < 0:
        p.error("--pass_k must be >= 0 (0: off)")
    args.base_dir = args.base_dir or str(base_dir())
    b = Path(args.base_dir)
    args.given = {k for k in GIVEN if getattr(args, k)}  # explicit inputs must be there; a default may be absent
    args.rm = args.rm if args.rm is not None else sorted(str(d) for d in (b / "rm_checkpoints").glob("*") if d.is_dir())
    args.score_rm = args.score_rm or str(b / "rm_checkpoints" / "uniform")
    args.policy_before = args.policy_before or str(b / "chatsft_checkpoints" / "default")
    args.policy_after = args.policy_after or str(b / "chatrl_checkpoints" / "uniform")
    args.eval_pairs = args.eval_pairs or str(b / "demo" / "eval_pairs.jsonl")
    args.eval_prompts = args.eval_prompts or str(b / "demo" / "eval_prompts.jsonl")
    args.tool_prompts = args.tool_prompts or str(b / "demo" / "eval_arithmetic.jsonl")
    args.out = args.out or str(b / "report.md")
    return args


GIVEN = ("rm", "score_rm", "policy_before", "policy_after", "policy", "eval_pairs", "eval_prompts", "tool_prompts",
         "reward_fn")


def check_inputs(args: argparse.Namespace) -> tuple[list, list, list]:
    """(eval pairs, eval prompts, tool prompts), every input checked before anything is loaded or decoded, as the
    trainers do: a file, model or RM given explicitly that is not there is one line (a default that is not there is
    left out); the rows parse; the task reward finds its reference in every row it scores (rewards.check_references)."""
    for flag in ("eval_pairs", "eval_prompts", "tool_prompts"):
        if flag in args.given and not Path(getattr(args, flag)).exists():
            raise InputError(f"--{flag}: file not found", path=getattr(args, flag))
    for flag, path in [("rm", d) for d in args.rm] + [("score_rm", args.score_rm)]:
        if flag in args.given and not Path(path).exists():
            raise InputError(f"--{flag}: not found", path=path)
    for k, (_, path) in enumerate([(args.before_name, args.policy_before)] + named_policies(args)):
        flag = "policy_before" if k == 0 else "policy" if args.policy else "policy_after"
        if flag in args.given and not is_policy(path):
            raise InputError(f"--{flag}: no model checkpoint or Hugging Face model here", path=path)
    pairs = load_pairs(args.eval_pairs)[0] if args.rm and Path(args.eval_pairs).exists() else []
    rows = load_prompts(args.eval_prompts) if Path(args.eval_prompts).exists() else []
    if args.eval_holdout is not None:  # what the trainers held out of these files (data.rows.split_by_prefix)
        pairs = [r for r in pairs if is_val_prefix(r.prefix_id, args.eval_holdout)]
        rows = [r for r in rows if is_val_prefix(r.prefix_id, args.eval_holdout)]
    tool_rows = load_prompts(args.tool_prompts) if rows and Path(args.tool_prompts).exists() else []
    if tool_rows and not {"tool_prompts", "reward_fn"} & args.given:  # the demo's, whose answers gsm8k cannot score
        print0(f"kat_eval: tool use not measured: {args.tool_prompts} needs its task reward as --reward_fn "
               f"(the demo's: nanochat_ext.tasks.synthetic:task_reward)")
        tool_rows = []
    task = args.reward_fn or ["gsm8k"]  # what pass@k and tool use score with
    if args.pass_k:
        check_references(task, rows, args.eval_prompts)
    check_references(task, tool_rows, args.tool_prompts)
    return pairs, rows, tool_rows


def is_policy(path: str) -> bool:
    """Whether path (or nanochat's short form, sft:d20) holds a model checkpoint or a Hugging Face model dir."""
    resolved = resolve_model_path(path)
    return find_checkpoint(resolved) is not None or (resolved / "config.json").is_file()


def named_policies(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--policy NAME=PATH pairs, else the one default 'after (GRPO)' policy."""
    if not args.policy:
        return [("after (GRPO)", args.policy_after)]
    bad = [spec for spec in args.policy if "=" not in spec]
    if bad:
        raise InputError(f"--policy takes NAME=PATH, got {bad[0]!r}")
    return [tuple(spec.split("=", 1)) for spec in args.policy]


def eval_policy(path: str, rows, tool_rows, scorer: RewardScorer | None, args,
                env: DistEnv, dtype: torch.dtype) -> dict:
    policy = load_backbone(path, env.device, vintage=args.nanochat_vintage, frozen=dtype)
    autocast = precision(dtype, env.device)
    tok = load_tokenizer_for(policy, None)
    mine = list(range(env.rank, len(rows), env.world_size))
    agent = Agent(config(AgentConfig, args), tok, (rows + tool_rows)[0].row)
    print0(f"{path}: {agent.describe()}")
    all_ids = encode_prompts(rows, agent.render_prompt, policy.max_seq_len, args.max_new_tokens, args.eval_prompts)
    tool_ids = encode_prompts(tool_rows, agent.render_prompt, policy.max_seq_len, args.tool_max_new_tokens,
                              args.tool_prompts, "--tool_max_new_tokens")  # before anything is decoded
    prompt_ids = [all_ids[i] for i in mine]
    results, engine = [], Engine(policy, agent=agent)
    for temperature, n in ((0.0, 1), (args.temperature, args.samples)):
        cfg = SamplingConfig(args.max_new_tokens, temperature)
        with autocast:
            out = engine.generate(prompt_ids, n, cfg, tok.stop_ids, tok.pad_id,
                                  [torch.Generator().manual_seed(sample_seed(args.seed, -2, i)) for i in mine],
                                  [rows[i].row for i in mine]) if mine else None
        comps = out.completions if out else []
        scores = scorer.score_ids([truncate(prompt_ids[k // n], tok.reply_ids(c), scorer.max_len, tok.bos_id)
                                   for k, c in enumerate(comps)],
                                  group=n) if scorer and comps else [math.nan] * len(comps)
        texts = out.replies(tok) if out else []
        results.append([(mine[k // n], texts[k], scores[k], len(comps[k])) for k in range(len(comps))])
    greedy, sampled = ([x for part in gather_objects(r) for x in part] for r in results)
    task = Rewards(None, args.reward_fn or ["gsm8k"], None)
    passes = evaluate_pass_k(engine, rows, all_ids, task, tok, SamplingConfig(args.max_new_tokens), args.pass_k,
                             args.seed, env, autocast, -(-len(rows) // env.world_size) * args.pass_k) \
        if args.pass_k else {}
    tool_use = {}
    if tool_rows and engine.agent:  # the same prompts with the tools and without them
        cfg = SamplingConfig(args.tool_max_new_tokens)
        per_rank = -(-len(tool_rows) // env.world_size)
        tool_use = evaluate_tool_use((engine, Engine(policy)), tool_rows, tool_ids, task, tok, cfg, args.seed, env,
                                     autocast, per_rank)
        if args.pass_k:
            tool_use.update({k.removeprefix("eval/"): v for k, v in evaluate_pass_k(
                engine, tool_rows, tool_ids, task, tok, cfg, args.pass_k, args.seed, env, autocast,
                per_rank * args.pass_k).items()})
    # Without the demo's topics, the task reward's verdicts (--reward_fn, 1: right), on every rank: a reward function
    # that fails stops every rank alike.
    verdicts = {mode: [v == 1 for v in task.task_scores(rows, [i for i, *_ in items], [t for _, t, _, _ in items])]
                for mode, items in (("greedy", greedy), ("sampled", sampled))} \
        if args.reward_fn and not all_judgeable(rows) else {}
    if not env.is_main:
        return {}
    return policy_measures(policy.source, rows, greedy, sampled, verdicts, passes, tool_use)


def eval_policies(rows, tool_rows, args: argparse.Namespace, env: DistEnv, dtype: torch.dtype) -> dict:
    """Each policy there is (a default that is not there is skipped) on the eval prompts, scored by --score_rm."""
    scorer = (load_reward_model(args.score_rm, env.device, backbone=args.rm_backbone)
              if "score_rm" in args.given or find_checkpoint(args.score_rm) else None)
    if scorer is not None:
        print0(compile_models(args.compile, env.device, scorer.model.backbone))
    policies = {}
    for name, path in [(args.before_name, args.policy_before)] + named_policies(args):
        if not is_policy(path):  # sft:d20 and checkpoint roots too
            print0(f"eval: no policy at {path}, skipped")
            continue
        policies[name] = eval_policy(path, rows, tool_rows, scorer, args, env, dtype)
        if env.is_main:
            print0(f"eval: {name} task accuracy sampled {fmt(policies[name]['task_accuracy_sampled'])}, "
                   f"rm score sampled {fmt(policies[name]['rm_score_sampled'])}")
    return policies


def evaluate(args: argparse.Namespace, session: Session) -> Path:
    env = session.env
    base, out = Path(args.base_dir), Path(args.out)
    dtype = compute_dtype(args.dtype, env.device)
    pairs, rows, tool_rows = check_inputs(args)
    # the policies first: a prompt too long for a policy's context stops the run before any other work
    policies = eval_policies(rows, tool_rows, args, env, dtype) if rows else {}
    rms = {}
    if pairs:
        topics = topics_of(args.eval_pairs)
        for d in args.rm:
            rms[d] = eval_rm(d, pairs, topics, env, args.rm_backbone, args.compile)
            print0(f"eval: rm {d} accuracy {rms[d]['overall']['accuracy']:.3f}")
    if not rms and not policies:
        raise InputError("nothing to evaluate: no reward model with eval pairs, no policy with eval prompts "
                         "(run the earlier stages, or pass --rm/--policy_after/--eval_pairs/--eval_prompts)",
                         path=str(base))
    if env.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        timings_file = base / "timings.tsv"
        timings = [(n, float(s)) for n, s in (line.split("\t") for line in timings_file.read_text().splitlines()
                                             if line.strip())] if timings_file.is_file() else []
        before = policies.get(args.before_name, {})
        plots = plot_curves(base, out.parent, args.reward_fn[0].rsplit(":", 1)[-1] if args.reward_fn else None,
                            {mode: before.get(f"task_accuracy_{mode}") for mode in ("greedy", "sampled")})
        passed = base / "stage_args.json"  # speedrun.sh's REGIME, step counts and *_ARGS of the stages that ran
        stage_args = json.loads(passed.read_text()) if passed.is_file() else {}
        ran = base / "stages.tsv"  # speedrun.sh's stages as they ran: name, command
        stages = [tuple(line.split("\t", 1)) for line in ran.read_text().splitlines() if "\t" in line] \
            if ran.is_file() else []
        out.with_suffix(".json").write_text(json.dumps({"reward_models": rms, "policies": policies,
                                                        "timings_s": dict(timings), "stage_args": stage_args,
                                                        "stages": dict(stages)}, indent=1))
        out.write_text(write_report(args.base_dir, rms, policies, timings, plots, stage_args, stages,
                                    pass_k=args.pass_k, samples=args.samples, temperature=args.temperature,
                                    score_rm=args.score_rm, tool_prompts=args.tool_prompts,
                                    holdout=args.eval_holdout))
    return out


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), evaluate, "report")

if __name__ == "__main__":
    sys.exit(main())
