"""A reward model on preference pairs: the command line of nanochat_ext/recipes/rm.py, whose run
nanochat_ext.api.train_rm is in Python (`python -m scripts.kat_train_rm --help`, docs/cli.md)."""
import sys

from nanochat_ext.recipes.rm import flags, main, parse_args, train  # noqa: F401  (the tests and kat_docs use them)

if __name__ == "__main__":
    sys.exit(main())
