"""The flags more than one of the scripts here takes, declared once beside them (the trainers' flags are their
configs' fields and their recipes' own, in nanochat_ext)."""
from __future__ import annotations

import argparse
from typing import Any

REQUIRED_FLAG = "required"  # in SCRIPT_FLAGS: the script's flag has no default
# The flags more than one script takes beside the configs' options (a trainer's are its recipe's), declared once: each
# flag's argparse keywords, and each script's default and what the flag is there ("(default: ...)" appended where the
# help does not say it). kat_fetch_model declares its own --out: it imports nothing beyond the standard library before
# it has to.
SCRIPT_FLAGS: dict[str, tuple[dict, dict[str, tuple[Any, str]]]] = {
    "base_dir": ({}, {
        "kat_demo_data": (None, "where to write (default: $NANOCHAT_BASE_DIR)"),
        "kat_eval": (None, "artifact root (default: $NANOCHAT_BASE_DIR)")}),
    "out": ({}, {
        "kat_compute_density": (None, "weights JSONL (default: $NANOCHAT_BASE_DIR/density/weights.jsonl)"),
        "kat_eval": (None, "report path (default: <base>/report.md)"),
        "kat_export_rm": (REQUIRED_FLAG, "new, empty directory to write"),
        "kat_own_pairs": (REQUIRED_FLAG, "the pairs' JSONL, a new file"),
        "kat_task_data": (None, "default: $NANOCHAT_BASE_DIR/tasks/<task>")}),
    "prompts": ({}, {
        "kat_compute_density": (None, "prompts (as for GRPO; docs/data.md)"),
        "kat_own_pairs": (REQUIRED_FLAG, "prompts with what the reward reads (answer, ...), as for GRPO")}),
    "rm": ({}, {
        "kat_eval": (None, "reward-model dirs to evaluate (default: every dir in <base>/rm_checkpoints)"),
        "kat_export_rm": (REQUIRED_FLAG, "reward-model checkpoint file or dir (its newest complete checkpoint)")}),
    "rm_backbone": ({}, {
        "kat_eval": (None, "the backbone of the RMs, where they cannot find it themselves (see kat_train_grpo "
                           "--help)"),
        "kat_export_rm": (None, "the RM's backbone, where the RM cannot find it itself")}),
    "seed": ({"type": int}, {
        "kat_demo_data": (0, "what is drawn: data, tokenizer, model"),
        "kat_eval": (0, "sampling"),
        "kat_own_pairs": (0, "sampling"),
        "kat_task_data": (0, "which questions are drawn")}),
    "policy": ({}, {
        "kat_eval": ([], "a trained policy to evaluate under NAME (repeatable), e.g. 'GRPO density=<dir>'; default: "
                          "--policy_after"),
        "kat_own_pairs": (REQUIRED_FLAG, "the model to sample (a nanochat checkpoint dir or a Hugging Face causal-LM "
                                         "dir)")}),
    "reward_fn": ({"action": "append"}, {
        "kat_eval": ([], "the task reward pass@k and tool use read, as for kat_train_grpo (default: gsm8k)"),
        "kat_own_pairs": (REQUIRED_FLAG, "the task's reward, as for kat_train_grpo (repeatable: their sum judges)")}),
    "samples": ({"type": int}, {
        "kat_eval": (4, "sampled completions per prompt"),
        "kat_own_pairs": (8, "completions sampled per prompt")}),
    "temperature": ({"type": float}, {
        "kat_eval": (1.0, "the sampled completions' temperature"),
        "kat_own_pairs": (1.0, "their temperature")}),
    "max_new_tokens": ({"type": int}, {
        "kat_eval": (512, "completion length limit (default: %(default)s, GRPO's; speedrun.sh passes the length its "
                          "GRPO policies trained with)"),
        "kat_own_pairs": (512, "completion length limit")}),
    "n_eval": ({"type": int}, {
        "kat_demo_data": (200, "held-out prompts, and twice as many pairs"),
        "kat_task_data": (64, "held-out prompts")}),
    "n_sft": ({"type": int}, {
        "kat_demo_data": (4000, "SFT conversations"),
        "kat_task_data": (256, "SFT demonstrations of the tool calls, for a task a tool solves")}),
}


def add_flag(p: argparse.ArgumentParser | argparse._ActionsContainer, script: str, name: str, **extra: Any) -> None:
    """One of SCRIPT_FLAGS, as `script` takes it (extra: keywords of this script's own, such as nargs)."""
    keywords, per_script = SCRIPT_FLAGS[name]
    default, text = per_script[script]
    if default == REQUIRED_FLAG:
        p.add_argument(f"--{name}", required=True, help=text, **keywords, **extra)
        return
    if default is not None and "default" not in text:
        text += " (default: %(default)s)"
    p.add_argument(f"--{name}", default=default, help=text, **keywords, **extra)
