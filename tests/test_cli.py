"""The trainers' command lines: a flag is declared once (a config's option, or one script's own input), each trainer
takes its own defaults from its TrainerSpec (algorithms/<method>.py), and --help shows every flag once, with help."""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib
import pickle
import pkgutil

import numpy as np
import pytest
from conftest import REPO

import nanochat_ext
from nanochat_ext.algorithms.trainers import SPECS
from nanochat_ext.api import python_run
from nanochat_ext.cli import TRAINERS, recorded
from scripts import kat_docs, kat_sft, kat_train_dpo, kat_train_grpo, kat_train_rm
from scripts.flags import REQUIRED_FLAG, SCRIPT_FLAGS

SCRIPTS = {"sft": kat_sft, "rm": kat_train_rm, "dpo": kat_train_dpo, "grpo": kat_train_grpo}
REQUIRED = {"sft": ["--backbone", "b", "--conversations", "c"], "rm": ["--backbone", "b", "--pairs", "p"],
            "dpo": ["--policy", "p", "--pairs", "p"], "grpo": ["--policy", "p", "--prompts", "p"]}


def options() -> dict[str, list[str]]:
    """Every config option of the package: flag name -> the configs that declare it."""
    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(nanochat_ext.__path__, "nanochat_ext."):
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__:
                for f in dataclasses.fields(cls):
                    if "flag" in f.metadata:
                        found.setdefault(f.name, []).append(cls.__qualname__)
    return found


def declared_in(trainer: str) -> set[str]:
    """The flags a trainer's script declares itself (add_argument), not through a config."""
    tree = ast.parse((REPO / "nanochat_ext" / "recipes" / f"{trainer}.py").read_text())
    return {node.args[0].value.removeprefix("--") for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument" and node.args
            and isinstance(node.args[0], ast.Constant)}


def test_a_flag_is_declared_once():
    """Each config option has one declaration; a script declares only what no config and no other trainer has (the
    model flags, declared by cli.trainer_parser)."""
    opts = options()
    # Only TRL's names of each method's own option (TRL's DPOConfig and GRPOConfig both have them): one trainer each
    assert {name: sorted(where) for name, where in opts.items() if len(where) > 1} == {
        "beta": ["DPOConfig", "GRPOConfig"], "loss_type": ["DPOConfig", "GRPOConfig"]}
    assert "lr" in opts and not any("lr" in declared_in(t) for t in TRAINERS)
    own = {t: declared_in(t) for t in TRAINERS}
    assert all(not own[t] & opts.keys() for t in TRAINERS), own
    assert all(not own[a] & own[b] for a in TRAINERS for b in TRAINERS if a < b), own


def test_no_two_scripts_declare_one_flag():
    """Beside the configs' options, a flag two scripts take is declared once, in scripts/flags.py's SCRIPT_FLAGS, and
    each script named there takes it with the default the table gives."""
    where: dict[str, list[str]] = {}
    for path in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                where.setdefault(node.args[0].value, []).append(path.stem)
    assert {flag: scripts for flag, scripts in where.items() if len(scripts) > 1} == {}
    for name, (_, per_script) in SCRIPT_FLAGS.items():
        for script, (default, _) in per_script.items():
            action = next(a for a in importlib.import_module(f"scripts.{script}").flags()._actions
                          if a.dest == name)
            assert action.required if default == REQUIRED_FLAG else action.default == default, (script, name)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_each_trainer_takes_its_own_defaults_and_lacks_what_it_does_not_have(trainer):
    args = SCRIPTS[trainer].parse_args(REQUIRED[trainer])
    assert SPECS[trainer].defaults.keys() == SPECS["sft"].defaults.keys()  # each spec says each of the shared flags
    for flag, own in SPECS[trainer].defaults.items():
        if own == "-":
            assert not hasattr(args, flag), (trainer, flag)
        elif flag != "lr":  # --lr stays None until the optimizer is known (OptimConfig.with_lr)
            assert getattr(args, flag) == own, (trainer, flag)
    assert args.lr is None


def help_entries(text: str) -> dict[str, str]:
    """--help's options: flag -> its help text (argparse writes it after the flag, or on the lines below it)."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")
            flag = invocation.split()[0].rstrip(",")
            assert flag not in entries, f"{flag} shown twice"
            entries[flag] = rest.strip()
        elif flag and line.startswith(" " * 8):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


@pytest.mark.parametrize("trainer", TRAINERS)
def test_help_shows_each_flag_once_with_its_help(trainer, capsys):
    """No dashed spelling in --help (it is still taken), and no flag without help."""
    with pytest.raises(SystemExit):
        SCRIPTS[trainer].parse_args(["--help"])
    entries = help_entries(capsys.readouterr().out)
    assert "--lr" in entries and "--max_steps" in entries and "--device" in entries
    assert [f for f in entries if "-" in f[2:]] == []
    assert [f for f, text in entries.items() if not text and f != "-h"] == []
    assert SCRIPTS[trainer].parse_args(REQUIRED[trainer] + ["--max-steps", "7"]).max_steps == 7


def test_every_flag_of_every_script_says_what_it_does_and_its_default():
    """Each script's flags (kat_docs.SCRIPTS: all of them): help on every one, and a default a flag takes is said."""
    formatter = argparse.HelpFormatter("x")
    for name in kat_docs.SCRIPTS:
        for action in importlib.import_module(f"scripts.{name}").flags()._actions:
            if action.dest == "help":
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert text, f"{name} {action.option_strings[0]} has no help"
            quiet = action.default in (None, False, [], argparse.SUPPRESS) or action.required
            assert quiet or "default" in text, f"{name} {action.option_strings[0]} does not say its default"


def test_the_flag_reference_is_current():
    """docs/cli.md is what the parsers say (python -m scripts.kat_docs writes it)."""
    assert (REPO / "docs" / "cli.md").read_text() == kat_docs.generate(), "stale: python -m scripts.kat_docs"


# The same options given on the command line and as Python values: every trainer's required inputs, then a mix of
# kinds (numbers, a choice, a flag, a list, an 'auto', a path), GRPO's preset (which a given option overrides) and
# TRL's --loss_type.
AS_PYTHON = {"sft": {"max_steps": 7, "lr": 1e-4, "device_batch_size": "auto", "dtype": "float32"},
             "rm": {"max_steps": 7, "batch_size": 4, "val_ratio": 0.1, "skip_bad_rows": True},
             "dpo": {"beta": 0.5, "loss_type": "ipo", "device_batch_size": 2, "out": REPO / "never"},
             "grpo": {"preset": "word_arithmetic", "group_size": 4, "loss_type": "dr_grpo", "top_k": np.int64(5),
                      "top_p": np.float64(0.9), "reward_weights": [1.0, 0.5], "reward_fn": ["last_number", "gsm8k"],
                      "log_rollouts": True}}
# What a command line says by leaving a flag off: None (the default), False (a flag not set), [] (none appended).
UNSAID = {"sft": {"tag": None}, "rm": {"log_dir": None}, "dpo": {"skip_bad_rows": False}, "grpo": {"max_steps": None,
          "filter_zero_std": False, "mask_truncated": False}}


def as_flags(options: dict) -> list[str]:
    argv = []
    for name, value in options.items():
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, list):
            argv += [f"--{name}", *map(str, value)] if name != "reward_fn" else \
                [s for v in value for s in (f"--{name}", v)]
        else:
            argv += [f"--{name}", str(value)]
    return argv


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_api_runs_what_the_command_line_runs_for_the_same_options(trainer):
    """#81 item 3: the API builds its run from Python values, with no command line in between, and it is the run the
    script parses from the same options as flags: every option at the same value (defaults, the trainer's own,
    a preset's, TRL's --loss_type resolved), the same given set, the same record a checkpoint keeps."""
    given = {**dict(zip(REQUIRED[trainer][::2], REQUIRED[trainer][1::2])), **AS_PYTHON[trainer]}
    given = {k.removeprefix("--"): v for k, v in given.items()}
    script = SCRIPTS[trainer].parse_args(as_flags(given))
    made = python_run(SCRIPTS[trainer].flags(), {**given, **UNSAID[trainer]})
    assert dict(made.options) == dict(script.options) and made.given == script.given == set(given)
    assert recorded(made) == recorded(script)
    assert pickle.loads(pickle.dumps(script)) == script and copy.deepcopy(made) == made
    if trainer == "grpo":
        assert script.loss_agg == "dr_grpo" and script.group_size == 4 and script.lr == 3e-5  # the preset's lr
        assert script.preset_values["max_new_tokens"] == 16 and "group_size" not in script.preset_values
    with pytest.raises(AttributeError, match="has no option 'no_such'"):
        script.no_such
    with pytest.raises(dataclasses.FrozenInstanceError):
        script.seed = 1
    with pytest.raises(TypeError):
        script.options["seed"] = 1
