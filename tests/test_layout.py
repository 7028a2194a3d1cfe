"""The package's layers: the README's Layout lists every module of nanochat_ext, lowest first, and each module
imports only modules listed above it (imports inside functions and under TYPE_CHECKING included)."""
from __future__ import annotations

import ast
import re

from conftest import REPO


def layers() -> list[str]:
    """The modules as the README's Layout lists them, lowest first."""
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("## Layout"):].split("```")[1]
    return re.findall(r"^  ([a-z0-9_]+) ", block, flags=re.MULTILINE)


def imports(module: str) -> set[str]:
    """Every nanochat_ext module `module` imports, wherever the import statement stands."""
    tree = ast.parse((REPO / "nanochat_ext" / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "nanochat_ext":
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanochat_ext."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("nanochat_ext."))
    return found


def test_the_layout_lists_every_module_once():
    listed = layers()
    package = sorted(p.stem for p in (REPO / "nanochat_ext").glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == package and len(set(listed)) == len(listed), (listed, package)


def test_every_import_goes_down_the_layers():
    order = {m: k for k, m in enumerate(layers())}
    upward = [f"{m} imports {other}, which the README's Layout lists after it" for m in order
              for other in sorted(imports(m)) if order[other] >= order[m]]
    assert not upward, upward
