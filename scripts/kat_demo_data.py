"""Demo stage: make the synthetic chat domain's assets in $NANOCHAT_BASE_DIR when no real ones are
given (see nanochat_ext/tasks/synthetic.py for the domain and its ground truth):

    tokenizer/tokenizer.pkl           RustBPE tokenizer trained on the domain's text
    base_checkpoints/demo/            a randomly initialised tiny nanochat GPT (SFT starts here)
    demo/sft.jsonl                    SFT conversations, deliberately imperfect, and arithmetic ones that call the
                                      calculator in nanochat's format
    demo/pairs.jsonl                  preference pairs (dismissive or off-topic rejections)
    demo/prompts.jsonl                GRPO prompts {prompt, topic}
    demo/eval_pairs.jsonl, demo/eval_prompts.jsonl   held-out sets for the report
    demo/eval_arithmetic.jsonl        held-out arithmetic prompts {prompt, topic, answer}: the report's tool use

    python -m scripts.kat_demo_data [--n_pairs 2000] [--seed 0]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from nanochat_ext.cli import parse, parser
from nanochat_ext.runtime.checkpoint import base_dir
from nanochat_ext.tasks import synthetic
from scripts.flags import add_flag


def flags() -> argparse.ArgumentParser:
    p = parser("kat_demo_data", __doc__)
    add_flag(p, "kat_demo_data", "base_dir")
    p.add_argument("--n_pairs", type=int, default=2000, help="preference pairs (default: %(default)s)")
    add_flag(p, "kat_demo_data", "n_sft")
    p.add_argument("--n_prompts", type=int, default=1000, help="GRPO prompts (default: %(default)s)")
    p.add_argument("--n_arithmetic", type=int, default=1000,
                   help="arithmetic SFT conversations that call the calculator (default: %(default)s)")
    add_flag(p, "kat_demo_data", "n_eval")
    p.add_argument("--vocab_size", type=int, default=512, help="tokenizer vocabulary (default: %(default)s)")
    add_flag(p, "kat_demo_data", "seed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse(flags(), argv)
    base, s = Path(args.base_dir) if args.base_dir else base_dir(), args.seed
    demo = base / "demo"
    tok = synthetic.make_tokenizer(base / "tokenizer", args.vocab_size, s)
    ckpt = synthetic.make_tiny_gpt(base / "base_checkpoints" / "demo", tok.vocab_size, s, n_layer=4, n_embd=128,
                                   n_head=4, n_kv_head=2)
    synthetic.write_jsonl(demo / "sft.jsonl", synthetic.make_conversations(args.n_sft, s + 1) +
                          synthetic.make_arithmetic_conversations(args.n_arithmetic, s + 6))
    synthetic.write_jsonl(demo / "pairs.jsonl", synthetic.make_pairs(args.n_pairs, s + 2, p_off_topic=0.4))
    synthetic.write_jsonl(demo / "prompts.jsonl", synthetic.make_prompts(args.n_prompts, s + 3))
    synthetic.write_jsonl(demo / "eval_pairs.jsonl", synthetic.make_pairs(2 * args.n_eval, s + 4, p_off_topic=0.4))
    synthetic.write_jsonl(demo / "eval_prompts.jsonl", synthetic.make_prompts(args.n_eval, s + 5))
    if args.n_arithmetic:
        synthetic.write_jsonl(demo / "eval_arithmetic.jsonl",
                              synthetic.make_arithmetic_prompts(args.n_eval // 2, s + 7))
    print(f"demo: tokenizer {base / 'tokenizer'}, base model {ckpt}, data in {demo}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
