"""Supervised fine-tuning on conversations: the command line of nanochat_ext/recipes/sft.py, whose run
nanochat_ext.api.train_sft is in Python (`python -m scripts.kat_sft --help`, docs/cli.md)."""
import sys

from nanochat_ext.recipes.sft import flags, main, parse_args, train  # noqa: F401  (the tests and kat_docs use them)

if __name__ == "__main__":
    sys.exit(main())
