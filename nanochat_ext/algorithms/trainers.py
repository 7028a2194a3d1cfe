"""The trainers, one registration line each: every method's TrainerSpec (its own file's), by name, which the command
lines' tables (cli.py), the resume check and the docs read. A new trainer is its algorithms/<method>.py with a SPEC,
its recipe, its script, and its line here.
"""
from __future__ import annotations

from nanochat_ext.algorithms import dpo, grpo, rm, sft
from nanochat_ext.config import TrainerSpec

SPECS: dict[str, TrainerSpec] = {s.name: s for s in (sft.SPEC, rm.SPEC, dpo.SPEC, grpo.SPEC)}
# A checkpoint's meta 'kind' -> the trainer that writes it, as a message names it (the resume check)
WRITERS = {s.kind: f"{s.script} ({s.wrote})" for s in SPECS.values()}
