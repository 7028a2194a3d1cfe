"""Writes docs/cli.md, the command-line reference, from every script's own parser; --check instead exits 1 where the
committed file differs from a fresh generation (the test suite checks it).

    python -m scripts.kat_docs            # after changing a flag
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from nanochat_ext.cli import reference

ROOT = Path(__file__).resolve().parent.parent
# In the order a newcomer meets them: the pipeline's stages, then the tools around them.
SCRIPTS = ("kat_sft", "kat_compute_density", "kat_train_rm", "kat_train_grpo", "kat_train_dpo", "kat_eval",
           "kat_experiment_report", "kat_export_rm", "kat_fetch_model", "kat_task_data",
           "kat_own_pairs", "kat_demo_data")


def generate() -> str:
    return reference({name: importlib.import_module(f"scripts.{name}").flags() for name in SCRIPTS}) + "\n"


def flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kat_docs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 where docs/cli.md is not what the parsers say")
    return p


def main(argv: list[str] | None = None) -> int:
    args = flags().parse_args(sys.argv[1:] if argv is None else argv)
    path, text = ROOT / "docs" / "cli.md", generate()
    if args.check:
        stale = not path.is_file() or path.read_text() != text
        print(f"{path}: {'stale: run python -m scripts.kat_docs' if stale else 'current'}")
        return int(stale)
    path.write_text(text)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
