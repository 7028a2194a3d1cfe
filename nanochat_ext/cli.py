"""What every script's command line shares: its parser generated from the configs' fields (config.option), with each
trainer's own defaults and words (its TrainerSpec), the dashed spellings (--max-steps) accepted but not shown; a
trainer's run (RunConfig), made from the command line here and from Python values by api.py, resolved the same way;
the run's options as its checkpoints record them, and the run of a script (one line and an exit code for every
failure).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from nanochat_ext.algorithms.rewards import function_name
from nanochat_ext.algorithms.trainers import SPECS
from nanochat_ext.config import NO, check_config
from nanochat_ext.data.batching import BatchConfig
from nanochat_ext.data.rows import DataConfig, InMemoryRows
from nanochat_ext.errors import EXIT_BAD_INPUT, InputError
from nanochat_ext.models.lora import LoraConfig
from nanochat_ext.presets import given_flags
from nanochat_ext.runtime.session import Session, SessionConfig, run, say
from nanochat_ext.training.loop import LoopConfig, OutputConfig
from nanochat_ext.training.optim import OptimConfig, check_optimizer
from nanochat_ext.training.setup import ModelConfig

# Each trainer's own defaults and words (its TrainerSpec, in algorithms/<method>.py), registered in
# algorithms/trainers.py; a script that trains nothing (None) has only these words.
TRAINERS = tuple(SPECS)
NO_TRAINER_WORDS = {"model": "model"}

MODEL_HELP = ("a nanochat checkpoint: a dir (its largest model_<N>.pt with meta_<N>.json; nanochat's zero-padded "
              "steps or our stamps), a model_<N>.pt file, a checkpoints root such as chatsft_checkpoints/ (its "
              "largest d<N> tag), or base|sft|rl[:tag] under $NANOCHAT_BASE_DIR (e.g. sft:d20); or a local "
              "Hugging Face causal-LM dir")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each flag once: the dashed spelling a flag also takes is not shown."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = copy.copy(action)
        shown.option_strings = [s for s in action.option_strings if not (s.startswith("--") and "-" in s[2:])]
        return super()._format_action_invocation(shown)


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, flags shown once."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)


def trainer_parser(trainer: str, doc: str | None) -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    """The trainer's script's parser and its inputs group, which holds the model it trains."""
    spec = SPECS[trainer]
    p = parser(spec.script, doc)
    g = p.add_argument_group("inputs")
    flag, what = spec.model_flag
    g.add_argument(flag, required=True, help=f"{what}: {MODEL_HELP}")
    return p, g


def add_config(p: argparse.ArgumentParser, cls: type, trainer: str | None, title: str,
               only: tuple[str, ...] | None = None) -> None:
    """The flags of `cls`'s options (those in `only`, where given) as one group of `trainer`'s parser (None: a script
    that trains nothing), with the trainer's defaults and words; a default the help does not say is appended."""
    g = p.add_argument_group(title)
    p.__dict__.setdefault("configs", []).append(cls)  # the configs its flags are made from (api.given_in)
    words = SPECS[trainer].words if trainer is not None else NO_TRAINER_WORDS
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata or (only is not None and f.name not in only):
            continue
        default = f.default
        if trainer is not None and f.name in SPECS[trainer].defaults:
            own = SPECS[trainer].defaults[f.name]
            if own == NO:
                continue
            default = default if f.name == "lr" else own
        if default is None and f.metadata["flag"].get("action") == "append":
            default = []  # what argparse appends to (a dataclass field cannot default to a list)
        text = f.metadata["help"]
        for key, word in words.items():
            text = text.replace("{" + key + "}", word)
        if default is not None and default is not False and "default" not in text:
            text += " (default: %(default)s)"
        g.add_argument(f"--{f.name}", default=default, help=text, **f.metadata["flag"])


def add_training(p: argparse.ArgumentParser, trainer: str, lora: bool = False) -> None:
    """The flags every trainer shares, each group once, with `trainer`'s defaults (lora: its --lora_* too)."""
    add_config(p, DataConfig, trainer, "data")
    add_config(p, BatchConfig, trainer, "batches")
    add_config(p, OptimConfig, trainer, "optimisation")
    add_config(p, LoopConfig, trainer, "steps, logging and evaluation")
    add_config(p, OutputConfig, trainer, "outputs")
    add_config(p, ModelConfig, trainer, "model")
    if lora:
        add_config(p, LoraConfig, trainer, "LoRA (peft)")
    add_config(p, SessionConfig, trainer, "runtime")


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The script's flags from argv (default: the command line's, torchrun's `--` dropped), a dashed spelling taken
    for its underscore one (--max-steps for --max_steps)."""
    required = [f"{a.option_strings[0]} {a.metavar or a.dest.upper()}" for a in p._actions if a.required]
    p.usage = " ".join(["%(prog)s", *required, "[options]"])  # the options are listed below, by group
    for action in p._actions:
        for flag in list(action.option_strings):
            if flag.startswith("--") and "_" in flag:
                alias = flag.replace("_", "-")
                action.option_strings.append(alias)
                p._option_string_actions[alias] = action
    return p.parse_args(script_argv(argv))


@dataclass(frozen=True)
class RunConfig:
    """A trainer's run as its recipe reads it: every option of its parser at its final value (given, a --preset's, the
    trainer's default; rows and functions given in Python as the objects they are), frozen. The command line makes it
    from argv (command_line_run), the Python API from configs and keywords (api.python_run): the same options,
    resolved the same way (the recipe's `resolve`: GRPO's preset and TRL's --loss_type). Read as attributes
    (run.seed), as typed configs (config(GRPOConfig, run)); its checkpoints record its options (recorded)."""
    script: str  # the trainer's script: its parser's prog
    options: Mapping[str, Any]
    given: frozenset[str]  # the options the user gave, whatever their values (a preset sets only the others)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # read-only

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["options"][name]
        except KeyError:
            raise AttributeError(f"{self.__dict__.get('script', 'the run')} has no option {name!r}") from None

    def __reduce__(self) -> tuple:  # pickled and copied as its plain values (a mappingproxy pickles not)
        return RunConfig, (self.script, dict(self.options), self.given)


def command_line_run(p: argparse.ArgumentParser, argv: list[str] | None) -> RunConfig:
    """The run the command line asks for: its flags parsed (parse), then resolved by the recipe."""
    argv = script_argv(argv)
    return resolved(p, vars(parse(p, argv)), given_flags(p, argv))


def resolved(p: argparse.ArgumentParser, options: dict[str, Any], given: set[str]) -> RunConfig:
    """The run of these options: the recipe's `resolve(options, given)` (set on its parser, where it has one) fills
    in what depends on other options, then the options are frozen."""
    options = dict(options)
    if clash := {f.name for f in dataclasses.fields(RunConfig)} & options.keys():  # a run's fields are not options
        raise ValueError(f"{p.prog}: an option may not be named {', '.join(sorted(clash))}")
    if (resolve := p.__dict__.get("resolve")) is not None:
        resolve(options, given)
    return RunConfig(p.prog, MappingProxyType(options), frozenset(given))


def script_argv(argv: list[str] | None) -> list[str]:
    """The script's own arguments; drops the `--` that `torchrun ... -m scripts.X -- ...` passes on."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def config(cls: type, args: argparse.Namespace | RunConfig):
    """`cls` from the flags of its fields the script has (the others keep their defaults), checked: one line naming a
    flag out of its range."""
    made = cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
    check_config(made)
    return made


@dataclass(frozen=True)
class Configs:
    """The configs every trainer builds from its flags, checked, its defaults resolved (--lr, --lora_alpha)."""
    model: ModelConfig
    data: DataConfig
    batch: BatchConfig
    optim: OptimConfig
    loop: LoopConfig
    out: OutputConfig
    lora: LoraConfig


def configs(args: RunConfig, trainer: str, adamw_lr: float | None = None) -> Configs:
    """`trainer`'s shared configs from its flags: one line for a flag out of range or a combination none can train.
    adamw_lr: --lr where not given, if the trainer's default depends on other flags (the RM's on what trains)."""
    model, out = config(ModelConfig, args), config(OutputConfig, args)
    out.check()
    lora = config(LoraConfig, args).resolved(model.parallel)
    optim = config(OptimConfig, args).with_lr(adamw_lr if adamw_lr is not None else SPECS[trainer].defaults["lr"])
    check_optimizer(optim.optimizer, bool(lora.lora_r), model.parallel)
    return Configs(model, config(DataConfig, args), config(BatchConfig, args), optim, config(LoopConfig, args), out,
                   lora)


def recorded(run: RunConfig, *configs: Any) -> dict:
    """The run's options as its checkpoints record them (by name, as its flags are named): as given, with what the run
    resolved (a default --lr, --max_len from the model's context, ...) from its final configs; what was given in
    Python (nanochat_ext.api) by its name."""
    flags = {k: recordable(v) for k, v in run.options.items()}
    resolved = {k: v for c in configs for k, v in dataclasses.asdict(c).items() if k in flags}
    return {**flags, **resolved}


def recordable(value: Any) -> Any:
    """A flag's value as a run records it: rows given in Python by their name, a function as module:qualname."""
    if isinstance(value, list):
        return [recordable(v) for v in value]
    if isinstance(value, InMemoryRows):
        return str(value)
    return function_name(value) if callable(value) else value


def run_script(args: argparse.Namespace | RunConfig, body: Callable[[Any, Session], object], label: str) -> int:
    """body(args, session) run by runtime.session.run with this script's flags: rank 0 prints `<label>: <result>`
    last; every failure ends with one line and its exit code."""
    return run_body(args, body, label)[0]


def run_body(args: argparse.Namespace | RunConfig, body: Callable[[Any, Session], object],
             label: str) -> tuple[int, object]:
    """run_script's run: (its exit code, what body returned, None unless the code is 0)."""
    try:
        session = config(SessionConfig, args)
    except InputError as e:
        say(f"error: {e}")
        return EXIT_BAD_INPUT, None
    returned: list[object] = []
    code = run(session, lambda s: returned.append(body(args, s)) or returned[0], label,
               group=getattr(args, "parallel", "ddp") == "fsdp",
               given=dict(args.options) if isinstance(args, RunConfig) else vars(args))
    return code, returned[0] if returned and code == 0 else None


def reference(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """docs/cli.md: every script's flags, group by group, each with its help and default, in markdown
    (scripts/kat_docs.py writes it; a test holds the committed file to the parsers)."""
    lines = ["# Command-line reference", "",
             "Generated from the scripts' own parsers by `python -m scripts.kat_docs` (a test fails when it is stale). "
             "Every flag also takes its dashed spelling (`--max-steps` for `--max_steps`).", ""]
    lines += [f"- [`{name}`](#{name})" for name in parsers] + [""]
    for name, p in parsers.items():
        summary = (p.description or "").strip().split("\n\n")[0].replace("\n", " ")
        lines += [f"## {name}", "", summary, "", "```", f"python -m scripts.{name} --help", "```", ""]
        formatter = p._get_formatter()
        for group in p._action_groups:
            actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.option_strings
                       and a.dest != "help"]
            if not actions:
                continue
            lines += [f"**{group.title}**", "", "| flag | what it does |", "|---|---|"]
            for a in actions:
                flag = next(s for s in a.option_strings if not (s.startswith("--") and "-" in s[2:]))
                value = "" if a.nargs == 0 else f" {a.metavar or a.dest.upper()}" if not a.choices else \
                    " {" + ",".join(map(str, a.choices)) + "}"
                text = formatter._expand_help(a).replace("|", "\\|").replace("\n", " ")
                lines.append(f"| `{flag}{value}`{' (required)' if a.required else ''} | {text} |")
            lines.append("")
    return "\n".join(lines)
