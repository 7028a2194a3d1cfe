"""The package's layers: docs/contributing.md's Layout lists every module of nanochat_ext, lowest first, in job folders
(runtime/, data/, models/, ...) below the few modules that stand beside them; each module imports only modules listed
above it (imports inside functions and under TYPE_CHECKING included), so a folder imports nothing from a folder
listed after it and there is no import circle."""
from __future__ import annotations

import ast
import re

from conftest import REPO

PACKAGE = REPO / "nanochat_ext"
MAX_LINES = 450


def layers() -> list[str]:
    """The modules as docs/contributing.md's Layout lists them, lowest first: 'errors', 'runtime.guard', ..."""
    page = (REPO / "docs" / "contributing.md").read_text()
    block = page[page.index("## Layout"):].split("```")[1]
    listed, folder = [], None
    for line in block.splitlines():
        if m := re.match(r"^  ([a-z0-9_]+)/ ", line):
            folder = m.group(1)
        elif m := re.match(r"^    ([a-z0-9_]+) ", line):
            listed.append(f"{folder}.{m.group(1)}")
        elif m := re.match(r"^  ([a-z0-9_]+) ", line):
            folder = None
            listed.append(m.group(1))
    return listed


def modules() -> list[str]:
    """Every module of the package, dotted below it ('runtime.guard'), its folders' __init__ left out."""
    return sorted(".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py")


def imports(module: str) -> set[str]:
    """Every nanochat_ext module `module` imports, wherever the import statement stands."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    tree = ast.parse((PACKAGE / f"{module.replace('.', '/')}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nanochat_ext":
            below = node.module.split(".")[1:]
            if not below:  # from nanochat_ext import errors
                found.update(a.name for a in node.names)
            elif below[0] in folders and len(below) == 1:  # from nanochat_ext.runtime import guard
                found.update(f"{below[0]}.{a.name}" for a in node.names)
            else:
                found.add(".".join(below))
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("nanochat_ext."))
    return found


def test_the_layout_lists_every_module_once():
    listed = layers()
    assert sorted(listed) == modules() and len(set(listed)) == len(listed), (listed, modules())


def test_every_import_goes_down_the_layers():
    order = {m: k for k, m in enumerate(layers())}
    upward = [f"{m} imports {other}, which docs/contributing.md's Layout lists after it" for m in order
              for other in sorted(imports(m)) if order[other] >= order[m]]
    assert not upward, upward


def test_a_folders_modules_stand_together():
    """A folder is one layer: its modules are listed one after another, never between another folder's."""
    folders = [m.split(".")[0] for m in layers() if "." in m]
    assert all(a == b or b not in folders[:k] for k, (a, b) in enumerate(zip(folders, folders[1:]))), folders


def test_no_module_is_over_450_lines():
    long = {m: n for m in modules() if (n := len((PACKAGE / f"{m.replace('.', '/')}.py").read_text().splitlines()))
            > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines, a module with two jobs: {long}"


def test_the_trainers_batches_are_typed():
    """A completion batch crosses the modules that fill and read it as a dataclass (Sequences, GRPO's RolloutBatch,
    DPO's PairBatch), never as a dict keyed by strings: no `batch["..."]` or `b["..."]` in the modules that make,
    slice, score or train on it. It fails on the code before RolloutBatch (grpo.py read `batch["engine_logp"]`)."""
    keyed = []
    for module in ("training.logprobs", "algorithms.rollout_batch", "algorithms.advantages", "algorithms.grpo",
                   "algorithms.dpo", "algorithms.sft"):
        tree = ast.parse((PACKAGE / f"{module.replace('.', '/')}.py").read_text())
        keyed += [f"{module}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                  and isinstance(node.slice.value, str) and isinstance(node.value, ast.Name)
                  and node.value.id in ("batch", "b", "x")]
    assert not keyed, keyed


def test_training_builds_no_rollout_engine():
    """training/ serves SFT, DPO and GRPO alike: none of its modules imports the engine, the agent or the sandbox
    (GRPO's engines are built in its own home, rollouts.DecodeSpec, from the whole policy PolicyTraining hands it).
    It fails on the code before: training/setup.py built GRPO's engines and imported engine.engine and agent.agent."""
    rollout_side = [f"{m} imports {other}" for m in modules() if m.startswith("training.")
                    for other in sorted(imports(m)) if other.split(".")[0] in ("engine", "agent", "sandbox")]
    assert not rollout_side, rollout_side


def test_code_carries_no_dates():
    """A date in code or its comments goes stale (history lives in commits and bench/RESULTS.md). Where a date is
    data, it stays: nanochat's vintages are named by the commits' dates (models/vintages.py)."""
    date = re.compile(r"\b20\d\d-\d\d-\d\d\b")
    dated = [f"{p.relative_to(REPO)}:{n}" for folder in ("nanochat_ext", "scripts", "tests")
             for p in sorted((REPO / folder).rglob("*.py")) if "fixtures" not in p.parts and p.name != "vintages.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if date.search(line)]
    assert not dated, dated
