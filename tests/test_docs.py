"""Docs that cannot rot: every script command in README.md and docs/ uses only flags its script has, and every variable
speedrun.sh reads is in the pipeline page's table of knobs."""
from __future__ import annotations

import importlib
import re

from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
STAGE_ARGS = {"SFT_ARGS": "kat_sft", "RM_ARGS": "kat_train_rm", "GRPO_ARGS": "kat_train_grpo",
              "DPO_ARGS": "kat_train_dpo", "EVAL_ARGS": "kat_eval", "DEMO_ARGS": "kat_demo_data"}


def accepted(script: str) -> set[str]:
    """The flags a script takes, each in its underscore and its dashed spelling."""
    flags = {s for a in importlib.import_module(f"scripts.{script}").flags()._actions for s in a.option_strings}
    return flags | {f.replace("_", "-") for f in flags}


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, the flags it is given) for each `-m scripts.X ...` command (joined across backslash-ended lines) and
    each `<STAGE>_ARGS="..."` of speedrun.sh."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in text.splitlines():
        for m in re.finditer(r"-m scripts\.(\w+)((?:\s+(?:--?[\w-]+|\"[^\"]*\"|'[^']*'|[^\s`|;&#]+))*)", line):
            found.append((m.group(1), re.findall(r"(?<![\w\"'=-])(--[a-z][\w-]*)", m.group(2))))
        for m in re.finditer(r"\b(\w+_ARGS)=\"([^\"]*)\"", line):
            if m.group(1) in STAGE_ARGS:
                found.append((STAGE_ARGS[m.group(1)], re.findall(r"(--[a-z][\w-]*)", m.group(2))))
    return found


def test_every_command_in_the_docs_uses_flags_its_script_has():
    unknown, seen = [], 0
    for doc in DOCS:
        for script, flags in commands(doc.read_text()):
            if not (REPO / "scripts" / f"{script}.py").is_file():
                unknown.append(f"{doc.name}: no script {script}")
                continue
            seen += 1
            unknown += [f"{doc.relative_to(REPO)}: {script} has no {flag}" for flag in flags
                        if flag not in accepted(script)]
    assert seen > 20 and not unknown, unknown


def test_the_check_finds_a_flag_a_script_does_not_have():
    found = commands('```\ntorchrun --standalone --nproc_per_node=8 -m scripts.kat_train_rm -- --backbone b \\\n'
                     '    --pairs p --no_such_flag 3\n```\nGRPO_ARGS="--lr 1e-3 --beta 0"')
    assert found == [("kat_train_rm", ["--backbone", "--pairs", "--no_such_flag"]),
                     ("kat_train_grpo", ["--lr", "--beta"])]
    assert "--no_such_flag" not in accepted("kat_train_rm") and "--max-steps" in accepted("kat_train_rm")


def test_every_variable_speedrun_reads_is_in_the_pipeline_page():
    reads = {m for f in ("speedrun.sh", "scripts/setup_env.sh")
             for m in re.findall(r"\$\{([A-Z_][A-Z0-9_]*):?-", (REPO / f).read_text())}
    page = (REPO / "docs" / "pipeline.md").read_text()
    table = page[page.index("## Knobs"):].split("\n## ")[0]
    listed = {name for row in table.splitlines() if row.startswith("| `")
              for name in re.findall(r"`([A-Z_][A-Z0-9_]*)`", row.split(" | ")[0])}
    assert {"NPROC_PER_NODE", "GRPO_ARGS", "SAVE_EVERY"} <= reads
    assert reads - listed == set(), f"speedrun.sh reads these, docs/pipeline.md's table lacks them: {reads - listed}"


def test_every_link_between_the_docs_resolves():
    """A relative link in README.md or docs/ names a file that is there."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not broken, broken
