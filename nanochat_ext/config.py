"""Typed configs: dataclasses whose fields say what they do, as TRL's configs do. A field made with `option()` is also a
command-line flag of the same name: its help, choices, type and valid range live here, beside the field, and the
scripts' parsers are generated from them (cli.py), so a flag is declared once whatever trainers have it. A trainer's
own facts (its defaults, its words, its checkpoints' kind) are its TrainerSpec, in its algorithms/<method>.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanochat_ext.errors import InputError

Check = tuple[Callable[[Any], bool], str]  # (test, what the value must be), for the one line naming the flag


def option(default: Any = None, help: str = "", *, check: Check | None = None, **flag: Any) -> Any:
    """A config field that is also a flag --<name>: `help` (may say %(default)s), `check` its valid range, and
    argparse's own keywords in `flag` (choices, type, nargs, action, metavar, required); a number's type is its
    default's where not given."""
    if isinstance(default, (int, float)) and not isinstance(default, bool) and "action" not in flag:
        flag.setdefault("type", type(default))
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "flag": flag})


def check_config(config: Any) -> None:
    """Every option of `config` in its range (None: not given, always fine): one line naming the flag otherwise."""
    for f in dataclasses.fields(config):
        value, check = getattr(config, f.name), f.metadata.get("check")
        if check is not None and value is not None and not check[0](value):
            raise InputError(f"--{f.name} must be {check[1]}, got {value!r}")


# Ranges that several options share.
POSITIVE: Check = (lambda v: v >= 1, ">= 1")
NON_NEGATIVE: Check = (lambda v: v >= 0, ">= 0")
FINITE_POSITIVE: Check = (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
FINITE_NON_NEGATIVE: Check = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
EVERY: Check = (lambda v: v >= 0, ">= 0 (0: only at the end)")


def micro_batch(value: str) -> int | str:
    """--device_batch_size: a positive number, or 'auto'."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1 or 'auto', got {value!r}")
    return n


NO = "-"  # in a TrainerSpec's defaults: the trainer has no such flag


@dataclass(frozen=True)
class TrainerSpec:
    """What a trainer is, said once, beside its method (algorithms/<method>.py; algorithms/trainers.py registers it):
    its flags' own defaults and words (cli.py's parser), its checkpoints' kind (the resume check), its measured lr
    cliff (the warning), the script that runs it (api.py, the docs)."""
    name: str  # "grpo": the run's name in its logs and flags' tables
    kind: str  # its checkpoints' meta kind ("grpo_policy"), which a resume checks
    script: str  # its command line, scripts/<script>.py ("kat_train_grpo"), and --help's prog
    wrote: str  # what its checkpoint is, where a message names the trainer that wrote one ("a GRPO policy")
    model_flag: tuple[str, str]  # the flag of the model it trains, and what that model is
    defaults: dict[str, Any]  # its own defaults of the shared flags (NO: it has no such flag); others: the field's
    words: dict[str, str]  # its words in the help the configs share ({unit}, {steps}, ...)
    lr_cliff: tuple[float, str] | None = None  # AdamW's --lr at which its sweep fell off a cliff, and what it saw
