"""--preset: a recipe of flag values in one flag, set where the command line does not give the flag, and what a
preset derives from the run itself (the tag of its default --out).

chat_rl is nanochat's RL recipe, scripts/chat_rl.py at 92d63d4: on-policy (one iteration, so no ratio and no clip), no
KL, advantage r - mean, token-level loss, Muon + AdamW at its rates x init-lr-frac 0.05 (--optimizer muon's default
--lr) decaying linearly to 0 over one epoch of the train prompts, no gradient clipping, 16 prompts x 16 samples of up
to 256 tokens at temperature 1 and top-k 50, the calculator on, GSM8K's reward, pass@1..8 (its --device-batch-size)
on 400 eval prompts every 60 steps, a checkpoint every 60 steps, all kept, in chatrl_checkpoints/d<depth>.

word_arithmetic is the real model's recipe (`MODEL=smollm2 bash speedrun.sh`, bench/ours_real_model.py) on
scripts/kat_task_data.py's questions: the last number of a reply against the answer, 4 questions x 8 samples of up to 16
tokens, lr 3e-5, no KL, an evaluation every 10 steps, 40 steps.

multiplication is its recipe with a tool (`MODEL=smollm2 TASK=multiplication bash speedrun.sh`, after a short SFT on
the tool-call format): the `multiply` tool (tasks/multiplication.py), at most 3 turns, 4 questions x 8 samples of up to
96 tokens (the call, the tool's turn and the answer), lr 3e-5, no KL, an evaluation every 8 steps, 16 steps.
"""
from __future__ import annotations

import argparse
import copy

from nanochat_ext.ddp_common import print0

PRESETS = {"chat_rl": {"beta": 0.0, "num_iterations": 1, "scale_rewards": "none", "loss_agg": "token",
                       "optimizer": "muon", "lr_decay": "linear", "warmup_steps": 0, "weight_decay": 0.0,
                       "grad_clip": 0.0, "batch_size": 16, "group_size": 16, "max_new_tokens": 256, "temperature": 1.0,
                       "top_k": 50, "top_p": 1.0, "tools": "calculator", "reward_fn": ["gsm8k"], "eval_every": 60,
                       "eval_examples": 400, "eval_pass_k": 8, "save_every": 60, "keep_last": 0, "num_epochs": 1},
           "word_arithmetic": {"reward_fn": ["last_number"], "batch_size": 4, "group_size": 8, "max_new_tokens": 16,
                               "lr": 3e-5, "beta": 0.0, "eval_every": 10, "max_steps": 40},
           "multiplication": {"reward_fn": ["last_number"], "tools": "nanochat_ext.tasks.multiplication:multiply",
                              "max_turns": 3, "batch_size": 4, "group_size": 8, "max_new_tokens": 96, "lr": 3e-5,
                              "beta": 0.0, "eval_every": 8, "max_steps": 16},
           "code_functions": {"env": "nanochat_ext.tasks.code_tests:CodeTests", "max_turns": 2, "batch_size": 4,
                              "group_size": 8, "max_new_tokens": 160, "lr": 3e-5, "beta": 0.0, "eval_every": 8,
                              "max_steps": 16}}


PRESET_HELP = ("a recipe of flag values in one flag: chat_rl, nanochat's RL recipe (scripts/chat_rl.py); "
               "word_arithmetic, the real model's (MODEL=smollm2 bash speedrun.sh); multiplication, the real model's "
               "with a tool (TASK=multiplication); code_functions, the real model writing code that runs against tests "
               "(TASK=code_functions); every value it sets is printed at start, and a flag given explicitly overrides "
               "it (docs/nanochat.md)")


def given_flags(p: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags argv gives explicitly, whatever their values (a preset leaves those alone)."""
    quiet = copy.deepcopy(p)
    for action in quiet._actions:
        action.default, action.required = argparse.SUPPRESS, False
    return set(vars(quiet.parse_known_args(argv)[0]))


def apply_preset(options: dict, given: set[str]) -> None:
    """Set options["preset"]'s values but for the options given explicitly; options["preset_values"] holds what it
    set (the start line prints them, the checkpoints record them)."""
    preset = options.get("preset")
    options["preset_values"] = {k: v for k, v in PRESETS[preset].items() if k not in given} if preset else {}
    options.update(options["preset_values"])


def print_preset(preset: str | None, values: dict) -> None:
    """Rank 0's start line naming every value the preset set (none without a preset)."""
    if preset:
        print0(f"preset {preset}: " + " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                                               for k, v in values.items()))


def preset_tag(preset: str | None, depth: int) -> str | None:
    """The tag of the preset's default --out: chat_rl writes where nanochat's chat_rl does and its load_model("rl")
    looks, chatrl_checkpoints/d<depth> (depth: the policy's layers, nanochat GPT's n_layer). None: the script's own
    default. A --tag or --out given explicitly wins, as chat_rl's --model-tag does."""
    return f"d{depth}" if preset == "chat_rl" else None
