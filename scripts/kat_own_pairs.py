"""Preference pairs in a policy's own words, for kat_train_dpo: --samples completions of each prompt sampled from
--policy, judged by the task's reward (--reward_fn); each prompt's best completion is chosen and its worst rejected,
where they differ (a prompt whose samples all score alike gives no pair). A pair keeps its prompt's kind fields
(kind, share, answer, topic) and both rewards. On N ranks each samples every N-th prompt; rank 0 writes the file,
whole or not at all.

    python -m scripts.kat_own_pairs --policy <model> --prompts <task>/train.jsonl --reward_fn last_number \
        --max_new_tokens 16 --out <task>/own_pairs.jsonl
    torchrun --standalone --nproc_per_node=8 -m scripts.kat_own_pairs -- <the same flags>
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from nanochat_ext.agent.agent import Agent, AgentConfig
from nanochat_ext.algorithms.own_pairs import own_words_pairs
from nanochat_ext.algorithms.rewards import Rewards, check_references
from nanochat_ext.cli import add_config, parse, parser, run_script
from nanochat_ext.data.batching import encode_prompts
from nanochat_ext.data.rows import load_prompts
from nanochat_ext.ddp_common import raise_if_any
from nanochat_ext.engine.engine import Engine
from nanochat_ext.engine.sampling import SamplingConfig
from nanochat_ext.errors import InputError
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from nanochat_ext.runtime.checkpoint import write_text_atomic
from nanochat_ext.runtime.outdir import check_writable
from nanochat_ext.runtime.precision import compute_dtype, precision
from nanochat_ext.runtime.session import Session, SessionConfig
from nanochat_ext.training.setup import ModelConfig
from scripts.flags import add_flag


def flags() -> argparse.ArgumentParser:
    p = parser("kat_own_pairs", __doc__)
    add_flag(p, "kat_own_pairs", "policy")
    add_flag(p, "kat_own_pairs", "prompts")
    add_flag(p, "kat_own_pairs", "reward_fn")
    add_flag(p, "kat_own_pairs", "out")
    add_flag(p, "kat_own_pairs", "samples")
    add_flag(p, "kat_own_pairs", "temperature")
    add_flag(p, "kat_own_pairs", "max_new_tokens")
    p.add_argument("--max_prompts", type=int, default=0, help="use the first N prompts (0: all)")
    p.add_argument("--prompts_per_call", type=int, default=16,
                   help="prompts a generate call decodes (each --samples rows; default: %(default)s)")
    add_flag(p, "kat_own_pairs", "seed")
    add_config(p, ModelConfig, None, "model", only=("nanochat_vintage", "dtype"))
    add_config(p, SessionConfig, None, "runtime")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags()
    args = parse(p, argv)
    for flag, least in (("samples", 2), ("max_new_tokens", 1), ("max_prompts", 0), ("prompts_per_call", 1)):
        if getattr(args, flag) < least:
            p.error(f"--{flag} must be >= {least}, got {getattr(args, flag)}")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        p.error(f"--temperature must be > 0 (greedy samples are all alike), got {args.temperature}")
    return args


def writable(out: Path) -> str | None:
    """Rank 0's check of --out before any sampling: not there yet (pairs are drawn once, before a DPO stage reads
    them), and its directory writable."""
    if out.exists():
        return f"--out {out}: exists (remove it to draw the pairs again)"
    return f"--out {out}: {error}" if (error := check_writable(out.parent)) else None


def make_pairs(args: argparse.Namespace, session: Session) -> str:
    env = session.env
    out = Path(args.out)
    raise_if_any(writable(out) if env.is_main else None)  # before the sampling, on every rank
    rows = load_prompts(args.prompts)[:args.max_prompts or None]
    rewards = Rewards(None, args.reward_fn, None)
    check_references(args.reward_fn, rows, args.prompts)  # before the model loads
    dtype = compute_dtype(args.dtype, env.device)
    policy = load_backbone(args.policy, env.device, vintage=args.nanochat_vintage, frozen=dtype)
    tok = load_tokenizer_for(policy, None)
    agent = Agent(AgentConfig(tools="none"), tok, rows[0].row if rows else None)
    prompt_ids = encode_prompts(rows, agent.render_prompt, policy.max_seq_len, args.max_new_tokens, args.prompts)
    engine = Engine(policy, agent=agent)
    cfg = SamplingConfig(args.max_new_tokens, args.temperature)
    pairs, counts = own_words_pairs(engine, rows, prompt_ids, rewards, tok, cfg, args.samples, args.seed, env,
                                    precision(dtype, env.device), args.prompts_per_call)
    if not pairs:  # every rank knows: the pairs were gathered to all
        raise_if_any(f"--prompts {args.prompts}: no pair: each prompt's {args.samples} samples scored alike under "
                     f"--reward_fn (mean reward {counts['mean_reward']:.3f}); sample more (--samples), hotter "
                     f"(--temperature) or other prompts")
    if env.is_main:
        try:
            write_text_atomic(out, "".join(json.dumps(p) + "\n" for p in pairs))
        except OSError as e:
            raise InputError(f"--out {out}: the pairs could not be written ({e.strerror})") from e
    return (f"{counts['pairs']} pairs from {counts['prompts']} prompts ({args.samples} samples each, mean reward "
            f"{counts['mean_reward']:.3f}) in {out}")


def main(argv: list[str] | None = None) -> int:
    return run_script(parse_args(argv), make_pairs, "own_pairs")


if __name__ == "__main__":
    sys.exit(main())
