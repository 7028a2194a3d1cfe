"""A trainer that dies like a killed job: `die_at_save.py MODULE N -- ARGS` runs scripts.MODULE with ARGS, and
the process that writes checkpoints (rank 0) exits at once (os._exit, code 9: no cleanup, no barrier) when it
has written its N-th state_<stamp>.pt, before that checkpoint's meta. Under torchrun the other ranks are then
torn down by the launcher, as a scheduler's kill would."""
import importlib
import os
import sys

from nanochat_ext import checkpoint

module, n = sys.argv[1], int(sys.argv[2])
written: list[str] = []


def die_at_nth_state(name: str) -> None:
    written.append(name)
    if sum(w.startswith("state_") for w in written) == n:
        os._exit(9)


checkpoint._SAVE_HOOK = die_at_nth_state
sys.exit(importlib.import_module(f"scripts.{module}").main(sys.argv[3:]))
