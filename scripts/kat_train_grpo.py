"""GRPO (and RLOO, REINFORCE++) on prompts with rewards: the command line of nanochat_ext/recipes/grpo.py, whose run
nanochat_ext.api.train_grpo is in Python (`python -m scripts.kat_train_grpo --help`, docs/cli.md)."""
import sys

from nanochat_ext.recipes.grpo import flags, main, parse_args, train  # noqa: F401  (the tests and kat_docs use them)

if __name__ == "__main__":
    sys.exit(main())
