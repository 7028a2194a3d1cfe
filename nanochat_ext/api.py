"""The four trainers in Python, for a notebook or a script of your own: each runs what its command line runs (the
same recipe, loop, checks and checkpoints; `python -m scripts.kat_train_grpo` is a thin caller of the same code), with
the options given as the typed configs the flags are made from and/or as keywords named as the flags are, rows as a
list of dicts or a `datasets.Dataset`, and GRPO's rewards as Python functions (docs/python.md has a complete example):
`api.train_grpo(RolloutConfig(group_size=8), policy=..., prompts=a_dataset, reward_fn=[my_reward], max_steps=20)`.

Each returns the checkpoint written (a Path). An option that is not the trainer's, or a value its flag refuses, raises
InputError before anything runs; a run that ends as a script would with an exit code raises RunFailed with that code
(2: bad input, as a row without its field), after the script's one line on stderr; Ctrl-C checkpoints at the end of
the step and raises KeyboardInterrupt (a second one raises at once: never an exit of the caller's process).
Under `torchrun --nproc_per_node=N your_script.py` every rank runs the same call, as the scripts' ranks do. Calls
follow one another in one process, each making and ending its own process group; the caller's signal handlers are
as they were after every call, and a call from a thread other than the main one installs none.

generate(checkpoint, prompts) and evaluate(checkpoint, prompts, reward_fn) ask a trained checkpoint as its training
asked it (algorithms/answers.py): its replies, and their mean rewards.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import numbers
import signal
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from nanochat_ext.algorithms import answers
from nanochat_ext.algorithms.answers import AnswerOptions
from nanochat_ext.algorithms.rewards import check_reward_fns
from nanochat_ext.algorithms.rewards import trl_style as trl_reward  # noqa: F401  (api.trl_reward(f): a TRL reward)
from nanochat_ext.cli import RunConfig, resolved, run_body
from nanochat_ext.data.rows import InMemoryRows
from nanochat_ext.errors import EXIT_INTERRUPTED, InputError, RunFailed
from nanochat_ext.recipes import dpo, grpo, rm, sft
from nanochat_ext.runtime import guard, session

# The options whose value may be rows given in Python rather than a file's path.
ROWS = ("conversations", "pairs", "prompts", "eval_prompts")
PROMPTS = ("prompts", "eval_prompts")  # of them, those whose rows may be bare prompts (a string, a message list)
# The options whose values may be Python functions rather than 'module:function' names.
FUNCTIONS = ("reward_fn",)


def train_sft(*configs: Any, **options: Any) -> Path:
    """Supervised fine-tuning (kat_sft): backbone=..., conversations=[{"messages": [...]}, ...] or a path."""
    return run_recipe(sft, configs, options)


def train_rm(*configs: Any, **options: Any) -> Path:
    """A reward model (kat_train_rm): backbone=..., pairs=[{"prompt", "chosen", "rejected"}, ...] or a path."""
    return run_recipe(rm, configs, options)


def train_dpo(*configs: Any, **options: Any) -> Path:
    """DPO (kat_train_dpo): policy=..., pairs=[{"prompt", "chosen", "rejected"}, ...] or a path."""
    return run_recipe(dpo, configs, options)


def train_grpo(*configs: Any, **options: Any) -> Path:
    """GRPO, RLOO, REINFORCE++ (kat_train_grpo): policy=..., prompts=[{"prompt", "answer"?}, ...] or a path, and a
    reward: reward_fn=[f(prompt, completion, row) -> float, or 'module:function'], rm=..., reward_url=... or env=..."""
    return run_recipe(grpo, configs, options)


def generate(checkpoint: str | Path, prompts: Any, options: AnswerOptions | None = None, **keywords: Any) -> list:
    """The checkpoint's replies to prompts (a list of strings, of message lists or of rows {"prompt", ...}, a
    datasets.Dataset, or a file's path), each rendered as its training rendered rollouts: its chat template, the
    generation prompt, the tools its run recorded. Options (AnswerOptions' fields, as keywords or an AnswerOptions):
    greedy by default, max_new_tokens the run's, n replies of each prompt at a temperature (prompt i samples from a
    seed of (seed, i) alone), tools="none" or others, device, batch_size. One reply per prompt (a list of str), or
    with n > 1 a list of n for each. Decoded by the rollout engine, batch_size prompts at a time, in this process."""
    o = answer_options(options, keywords)
    got = answers.replies(checkpoint, answers.prompt_rows(prompts), o)
    return [r[0] for r in got] if o.n == 1 else got


def evaluate(checkpoint: str | Path, prompts: Any, reward_fn: Any, options: AnswerOptions | None = None,
             **keywords: Any) -> dict[str, float]:
    """As the run's held-out evaluation logs them, over the checkpoint's replies to prompts (generate()'s, its
    options alike: greedy by default, as eval/reward_greedy): each reward function's mean, `reward_<name>`, their sum,
    `reward`, and `unscored`, the replies the machine could not score (counted 0). reward_fn: as train_grpo's
    (functions, built-in names, 'module:function'), each checked before the model loads."""
    o, rows, fns = answer_options(options, keywords), answers.prompt_rows(prompts), functions(reward_fn)
    check_reward_fns(fns, rows, rows[0].path)
    return answers.mean_rewards(rows, answers.replies(checkpoint, rows, o), fns)


def answer_options(options: AnswerOptions | None, keywords: dict[str, Any]) -> AnswerOptions:
    """generate()'s options: the AnswerOptions given, its fields replaced by the keywords; one that is none of its
    fields refused as train_*'s are, with the nearest."""
    fields = {f.name: f for f in dataclasses.fields(AnswerOptions)}
    for name in keywords:
        if name not in fields:
            refuse(f"generate has no option {name!r}{nearest(name, fields)} (its options: {', '.join(fields)})")
    return dataclasses.replace(options or AnswerOptions(), **keywords)


def functions(value: Any) -> list:
    """A reward_fn option as a list: one function or name, or several."""
    return [value] if callable(value) or isinstance(value, str) else list(value)


def run_recipe(recipe: ModuleType, configs: tuple[Any, ...], options: dict[str, Any]) -> Path:
    """The recipe's run with these options, as its script runs the same options given as flags."""
    parser = recipe.flags()
    trainer = parser.prog
    run = python_run(parser, {**given_in(configs, parser, trainer), **options})
    guard.in_process = True  # a second Ctrl-C raises KeyboardInterrupt here, never exits the caller's process
    try:
        code, checkpoint = run_body(run, recipe.train, "checkpoint")
    finally:
        guard.in_process = False
    if code == EXIT_INTERRUPTED and guard.signal_number == signal.SIGINT:  # Ctrl-C, checkpointed: as Python's own
        raise KeyboardInterrupt(f"{trainer} checkpointed and stopped at Ctrl-C; call again with resume='latest'")
    if code:
        raise RunFailed(trainer, code, session.last_line) from session.last_failure
    return checkpoint


def given_in(configs: tuple[Any, ...], parser: argparse.ArgumentParser, trainer: str) -> dict[str, Any]:
    """The options the configs set: each field that differs from its class's default (a field left at it keeps the
    trainer's own default, which may differ: docs/cli.md)."""
    options, classes = {a.dest for a in parser._actions}, parser.configs
    given = {}
    for cfg in configs:
        if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
            refuse(f"{trainer} takes configs (dataclass instances such as GRPOConfig(beta=0.0)) and keywords, "
                   f"got {cfg!r}")
        if type(cfg) not in classes:
            refuse(f"{type(cfg).__name__} is not a config of {trainer} (its configs: "
                   f"{', '.join(c.__name__ for c in classes)})")
        for f in dataclasses.fields(cfg):
            if "flag" not in f.metadata or getattr(cfg, f.name) == f.default:
                continue
            if f.name not in options:
                refuse(f"{type(cfg).__name__}.{f.name} is not an option of {trainer} (its options: docs/cli.md)")
            given[f.name] = getattr(cfg, f.name)
    return given


def python_run(parser: argparse.ArgumentParser, given: dict[str, Any]) -> RunConfig:
    """The run these Python values ask for, as the script's parser would run them given as flags: each option checked
    (python_options), the options given (a preset sets only the others) those a command line would have: not None, a
    flag (store_true) True, a list not empty."""
    options = python_options(given, parser, parser.prog)
    said = {k for k, v in given.items()
            if v is not None and v is not False and not (isinstance(v, (list, tuple)) and not v)}
    return resolved(parser, options, said)


def python_options(given: dict[str, Any], parser: argparse.ArgumentParser, trainer: str) -> dict[str, Any]:
    """Every option of the trainer: its flag's default where not given (None: the default), else the value given,
    checked as its flag checks a value (type, choices, a list where the flag takes several) without a command line in
    between; rows and functions given in Python as the objects they are."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    options = {dest: a.default for dest, a in actions.items()}
    for name, value in given.items():
        action = actions.get(name)
        if action is None:
            refuse(f"{trainer} has no option {name!r}{nearest(name, actions)} (its options are its flags: "
                   f"docs/cli.md)")
        if value is None:
            continue
        if name in ROWS and not isinstance(value, (str, Path)):
            options[name] = InMemoryRows(value, f"{name}: {described(value)}", prompts=name in PROMPTS)
        elif name in FUNCTIONS:
            options[name] = [v if callable(v) else option_value(action, v, trainer) for v in functions(value)]
        elif isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                refuse(f"{trainer}'s option {name} is True or False, got {value!r}")
            options[name] = value
        elif isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
            if not isinstance(value, (list, tuple)):
                refuse(f"{trainer}'s option {name} takes a list, got {value!r}")
            if not value and action.nargs == "+":
                refuse(f"{trainer}: argument --{name}: expected at least one value, got []")
            options[name] = [option_value(action, v, trainer) for v in value]
        else:
            options[name] = option_value(action, value, trainer)
    missing = [f"--{dest}" for dest, a in actions.items() if a.required and options[dest] is None]
    if missing:
        refuse(f"{trainer}: the following arguments are required: {', '.join(missing)}")
    return options


def option_value(action: argparse.Action, value: Any, trainer: str) -> Any:
    """One value as its flag takes it: a number for a number's flag (an int for an int's), its type's reading of a
    string (as the flag reads its text), text for a flag of text (a path as its text); one of its choices."""
    kind = action.type
    if kind in (int, float) and isinstance(value, numbers.Real) and not isinstance(value, bool) and \
            (kind is float or isinstance(value, numbers.Integral)):
        value = kind(value)  # numpy's numbers too: a sweep over np.arange or np.logspace
    elif kind is not None:
        if not isinstance(value, (str, Path)) and kind in (int, float):
            refuse(f"{trainer}: argument --{action.dest}: invalid {kind.__name__} value: {value!r}")
        try:
            value = kind(str(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            said = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"invalid {kind.__name__} value: {value!r}"
            refuse(f"{trainer}: argument --{action.dest}: {said}")
    elif not isinstance(value, str):
        value = str(value)  # a flag of text: a path, a number as the text it is
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        refuse(f"{trainer}: argument --{action.dest}: invalid choice: {value!r} (choose from {choices})")
    return value


# TRL's names for the same options (GRPOConfig's, DPOConfig's, TrainingArguments'), said where a user gives one
TRL_NAMES = {"num_generations": "group_size", "max_completion_length": "max_new_tokens", "learning_rate": "lr",
             "output_dir": "out", "per_device_train_batch_size": "device_batch_size", "num_train_epochs": "num_epochs",
             "logging_steps": "log_every", "save_steps": "save_every", "epsilon": "clip_eps",
             "epsilon_high": "clip_eps_high", "resume_from_checkpoint": "resume"}


def nearest(name: str, options: dict[str, Any]) -> str:
    """', TRL's num_generations is group_size here' or '; did you mean max_steps?' (difflib's nearest), or ''."""
    if TRL_NAMES.get(name) in options:
        return f": TRL's {name} is {TRL_NAMES[name]} here"
    close = difflib.get_close_matches(name, [o for o in options if o != "help"], n=1, cutoff=0.7)
    return f"; did you mean {close[0]}?" if close else ""


def described(rows: Any) -> str:
    """What rows given in Python are, for messages: 'a Dataset of 64 rows'."""
    try:
        n = f" of {len(rows)} row{'' if len(rows) == 1 else 's'}"
    except TypeError:
        n = ""
    return f"a {type(rows).__name__}{n}"


def refuse(message: str) -> NoReturn:
    raise InputError(message)
