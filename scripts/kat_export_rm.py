"""Export a reward model as one self-contained directory (head, backbone, tokenizer) to share it or
move it to another machine: it loads as --rm anywhere, with no other file.

    python -m scripts.kat_export_rm --rm $NANOCHAT_BASE_DIR/rm_checkpoints/uniform --out /shared/my_rm
"""
from __future__ import annotations

import argparse
import sys

from nanochat_ext.cli import add_dashed_aliases, run_plain, script_argv
from nanochat_ext.reward import export_reward_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kat_export_rm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rm", required=True, help="reward-model checkpoint file or dir (its newest complete checkpoint)")
    p.add_argument("--out", required=True, help="new, empty directory to write")
    p.add_argument("--rm_backbone", default=None, help="the RM's backbone, where the RM cannot find it itself")
    add_dashed_aliases(p)
    args = p.parse_args(script_argv(argv))
    return run_plain(lambda: export_reward_model(args.rm, args.out, args.rm_backbone), "exported")


if __name__ == "__main__":
    sys.exit(main())
