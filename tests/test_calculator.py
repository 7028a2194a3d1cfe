"""The calculator against nanochat's own `use_calculator` (tests/fixtures/nanochat-tool-use/calculator.json, made
by nanochat 92d63d4): the same text for every expression nanochat accepts, a refusal for every one it refuses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO

from nanochat_ext.agent.calculator import calculate

ENTRIES = json.loads((REPO / "tests/fixtures/nanochat-tool-use/calculator.json").read_text())["entries"]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["expr"][:40] for e in ENTRIES])
def test_calculator_gives_nanochats_text_or_refuses_where_it_does(entry):
    got = calculate(entry["expr"])
    if entry["str"] is None and not entry["returned_none"]:  # nanochat returns a value str() cannot print:
        assert got is None  # its Engine would crash; we refuse
    else:
        assert got == entry["str"], entry


@pytest.mark.parametrize("expr", ["().__class__.__bases__", "'a'.count('a') or open('x')", "'x'.count('y') or exit()",
                                  "'a'.zfill(999999999).count('0')", "9" * 3000 + "*" + "9" * 3000,
                                  "'ab'.count('a') or ''.join('a'.split())".replace("join", "__len__"), "lambda",
                                  "'a'.count('a') if print('x') else 1", "'a'.count('b') or x.count('a')",
                                  "'abc'.count('a').lower()", "'abc'.lower.count('a')", "'ab'.count('a') and 'x'.real"])
def test_hostile_and_huge_expressions_are_refused(expr):
    assert calculate(expr) is None


def test_string_methods_and_logic_as_python_computes_them():
    for expr in ["'abc'.count('z') or 'none'", "'Hello World'.lower().count('o')", "'banana'.count('an') and 'yes'",
                 "'a b c'.split().count('b')", "'abc'.count('a') if 'b' in 'abc' else 0", "not 'a'.count('b')"]:
        assert calculate(expr) == str(eval(expr, {"__builtins__": {}}, {})), expr


def test_it_runs_in_threads():
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, calculate(f"{i}*3"))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: str(i * 3) for i in range(8)}


def test_the_models_text_parses_without_a_warning_for_the_user():
    """A reply's expression such as `'ab'.count('a') if 1else 0` makes Python's parser warn (invalid decimal
    literal) where the user reads warnings: the calculator parses it quietly, and answers as Python does; the same
    text parsed elsewhere still warns. In a fresh interpreter, with the filters a run has (pytest's own override
    every filter in a test)."""
    code = ("import warnings\n"
            "from nanochat_ext.agent.calculator import calculate\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    print(calculate(\"'ab'.count('a') if 1else 0\"))\n"
            "    compile('1if 1 else 0', '<elsewhere>', 'eval')\n"
            "print([(str(w.message), w.filename) for w in seen])\n")
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ran.stdout.splitlines() == ["1", "[('invalid decimal literal', '<elsewhere>')]"], ran.stderr[-2000:]
