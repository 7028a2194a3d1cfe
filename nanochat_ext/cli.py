"""What every script's command line shares: dashed flag aliases and the run wrapper that turns
bad input into one clear line and a non-zero exit on every rank."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from nanochat_ext.ddp_common import DistEnv, detect_launcher, dist_session
from nanochat_ext.errors import InputError

EXIT_BAD_INPUT = 2


def add_dashed_aliases(parser: argparse.ArgumentParser) -> None:
    """Accept --max-steps wherever --max_steps is defined (the underscore spelling is canonical)."""
    for action in parser._actions:
        for flag in list(action.option_strings):
            if flag.startswith("--") and "_" in flag:
                alias = flag.replace("_", "-")
                action.option_strings.append(alias)
                parser._option_string_actions[alias] = action


def script_argv(argv: list[str] | None) -> list[str]:
    """The script's own arguments; drops the `--` that `torchrun ... -m scripts.X -- ...` passes on."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def run_script(args: argparse.Namespace, body: Callable[[argparse.Namespace, DistEnv], None]) -> int:
    """Run body(args, env) inside a process-group session that is always torn down. InputError:
    rank 0 prints `error: ...` to stderr and every rank exits with EXIT_BAD_INPUT."""
    try:
        with dist_session(args.device, args.backend, args.dist_timeout) as env:
            body(args, env)
    except InputError as e:
        if detect_launcher()[1] == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0
