"""DPO (and IPO, hinge, SimPO) on preference pairs: the command line of nanochat_ext/recipes/dpo.py, whose run
nanochat_ext.api.train_dpo is in Python (`python -m scripts.kat_train_dpo --help`, docs/cli.md)."""
import sys

from nanochat_ext.recipes.dpo import flags, main, parse_args, train  # noqa: F401  (the tests and kat_docs use them)

if __name__ == "__main__":
    sys.exit(main())
