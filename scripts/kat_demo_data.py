"""Demo stage: make the synthetic chat domain's assets in $NANOCHAT_BASE_DIR when no real ones are
given: a RustBPE tokenizer, a tiny nanochat base checkpoint, preference pairs and GRPO prompts.

    python -m scripts.kat_demo_data [--n_pairs 2000] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from nanochat_ext import synthetic
from nanochat_ext.cli import add_dashed_aliases, script_argv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kat_demo_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base_dir", default=os.environ.get("NANOCHAT_BASE_DIR", str(Path.home() / ".cache" / "nanochat")),
                   help="where to write (default: $NANOCHAT_BASE_DIR)")
    p.add_argument("--n_pairs", type=int, default=2000, help="preference pairs to generate (default: %(default)s)")
    p.add_argument("--vocab_size", type=int, default=512, help="tokenizer vocabulary (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    add_dashed_aliases(p)
    args = p.parse_args(script_argv(argv))
    base = Path(args.base_dir)
    tok = synthetic.make_tokenizer(base / "tokenizer", args.vocab_size, args.seed)
    ckpt = synthetic.make_tiny_gpt(base / "base_checkpoints" / "demo", tok.vocab_size, args.seed, n_layer=4,
                                   n_embd=128, n_head=4, n_kv_head=2)
    pairs = synthetic.write_jsonl(base / "demo" / "pairs.jsonl", synthetic.make_pairs(args.n_pairs, args.seed))
    prompts = synthetic.write_jsonl(base / "demo" / "prompts.jsonl",
                                    [{"prompt": r["prompt"]} for r in synthetic.make_pairs(args.n_pairs // 4, args.seed + 7)])
    print(f"demo: tokenizer {base / 'tokenizer'}, backbone {ckpt}, pairs {pairs}, prompts {prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
