"""Export a reward model as one self-contained directory to share it or move it to another machine.

--format native (default): head, backbone and tokenizer in this project's layout; it loads as --rm anywhere,
with no other file. --format hf (an RM on a Hugging Face backbone): a transformers sequence classifier
(`AutoModelForSequenceClassification`, num_labels 1, safetensors, with its tokenizer) that transformers, TRL and
vLLM load, scoring as this project does; it loads as --rm here too.

    python -m scripts.kat_export_rm --rm $NANOCHAT_BASE_DIR/rm_checkpoints/uniform --out /shared/my_rm
    python -m scripts.kat_export_rm --rm rm_checkpoints/llama --format hf --out /shared/my_rm_hf
"""
from __future__ import annotations

import argparse
import sys

from nanochat_ext.cli import parse, parser
from nanochat_ext.models.reward_model import export_hf_classifier, export_reward_model
from nanochat_ext.runtime.session import run_plain
from scripts.flags import add_flag


def flags() -> argparse.ArgumentParser:
    p = parser("kat_export_rm", __doc__)
    add_flag(p, "kat_export_rm", "rm")
    add_flag(p, "kat_export_rm", "out")
    add_flag(p, "kat_export_rm", "rm_backbone")
    p.add_argument("--format", choices=("native", "hf"), default="native",
                   help="native: this project's layout; hf: a transformers sequence classifier (Hugging Face "
                        "backbones) (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse(flags(), argv)
    export = export_hf_classifier if args.format == "hf" else export_reward_model
    return run_plain(lambda: export(args.rm, args.out, args.rm_backbone), "exported")


if __name__ == "__main__":
    sys.exit(main())
