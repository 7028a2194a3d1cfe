"""Code checked by tests: the example environment in which the model's code runs (docs/tools.md).

Each prompt row carries "tests": Python asserts, as MBPP writes them (`assert add(2, 3) == 5`). After each assistant
turn the environment takes the turn's last ```python block (or the whole turn, where it has none) and runs it sealed
(runtime/sandbox.py: its own namespaces where the OS allows them, no network, the filesystem read-only but its own
directory, limits on time, memory, files and processes, every process it starts ended with it), then the tests in
order. The verdict is made here, not by the code's process: an assert written `<expression> <op> <literal>` (==, !=,
<, <=, >, >=, in, not in, is, is not; `not` in front too) sends only the expression to the sandbox and compares the
plain value that comes back (int, str, list, ...; never an object of the code's, so no `__eq__` of its own) with
the literal, which the code never sees. Exiting early by any route, patching the tests, writing on the results pipe
or killing its own process all leave a test without its value: a failure. Any other assert is judged by the truth
value the code's process computes, and the tests' other statements (imports, helpers) run there, in order: write
the tests as comparisons with literals to keep the verdict out of the code's reach.

The environment answers with the first failure (what a test's expression gave, never what it should have given) so
that the model can try again, and ends the episode when every test passes. Its reward is 1 if they passed, else 0.

    python -m scripts.kat_train_grpo --policy ... --prompts problems.jsonl \
        --env nanochat_ext.tasks.code_tests:CodeTests --max_turns 3
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from nanochat_ext.errors import InputError
from nanochat_ext.runtime import sandbox

TIME_LIMIT = 5.0  # seconds of wall clock (and of CPU) a run may take, where the run gives no --tool_timeout
MEMORY_MB = 512  # address space a process of the run may map
CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
OPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b}


@dataclass(frozen=True)
class Check:
    """One assert: the expression the sandbox evaluates, and how its value is judged here: compared with a literal
    (op(value, literal), or op(literal, value) where the literal stands first), else by its truth; `not`s folded."""
    probe: str
    op: Callable[[Any, Any], bool] | None = None
    literal: Any = None
    literal_first: bool = False
    negated: bool = False

    def holds(self, value: Any) -> bool:
        if self.op is None:
            ok = bool(value)
        else:
            ok = self.op(self.literal, value) if self.literal_first else self.op(value, self.literal)
        return ok != self.negated


def literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def check_of(test: ast.expr) -> Check:
    negated = False
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        negated, test = not negated, test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in OPS:
        op, (left, right) = OPS[type(test.ops[0])], (test.left, test.comparators[0])
        for probe, other, first in ((left, right, False), (right, left, True)):
            is_literal, value = literal(other)
            if is_literal and not literal(probe)[0]:
                return Check(ast.unparse(probe), op, value, first, negated)
    return Check(ast.unparse(test), negated=negated)


def parse_tests(tests: str) -> tuple[list[tuple[str, str, str]], dict[int, Check]]:
    """The sandbox's steps for a row's tests (statements run in order, each assert's expression a probe) and each
    probe's check, by its step (the code is step 0). InputError where the tests do not parse or hold no assert."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as e:
        raise InputError(f"tests: line {e.lineno}: {e.msg}") from None
    steps, checks = [], {}
    for node in tree.body:
        if isinstance(node, ast.Assert):
            check = check_of(node.test)
            checks[len(steps) + 1] = check
            steps.append(("truth" if check.op is None else "value", check.probe, f"test {len(checks)}"))
        else:
            steps.append(("exec", ast.unparse(node), "the tests"))
    if not checks:
        raise InputError("tests: no assert to check")
    return steps, checks


def verdict(run: sandbox.Run, steps: list, checks: dict[int, Check], limits: sandbox.Limits) -> tuple[bool, str]:
    """(passed, what the model reads): every test's value came back and holds, else the first failure."""
    n = len(checks)
    if not run.ran:
        return False, f"the sandbox could not run the code ({run.sealed})"
    if 0 in run.errors:
        return False, f"the code {run.errors[0]}"
    for k in range(1, len(steps) + 1):
        check, name = checks.get(k), steps[k - 1][2]
        where = f"{name} of {n}" if check else f"the tests' statement `{steps[k - 1][1][:60]}`"
        if k in run.errors:
            return False, f"{where}: {'' if check is None else check.probe[:80] + ' '}{run.errors[k]}"
        if check is None:
            continue
        if k not in run.values:
            return False, f"the code's process ended ({run.ended(limits)}) before {name} of {n} gave its value"
        try:
            holds = check.holds(run.values[k])
        except Exception as e:  # a comparison of unlike types (TypeError), as the assert itself would raise
            return False, f"{where}: {check.probe[:80]} gave {shown(run.values[k])}, which cannot be compared " \
                          f"({type(e).__name__})"
        if not holds:
            gave = f"was {str(bool(run.values[k])).lower()}" if check.op is None else f"gave {shown(run.values[k])}"
            return False, f"{where}: {check.probe[:80]} {gave}"
    if run.garbled:
        return False, f"the tests' results could not be read: the code {run.garbled}"
    return True, "all tests passed"


def shown(value: Any) -> str:
    """A value the code gave, as the model reads it: its repr, cut (an int too long to print, by its size)."""
    try:
        text = repr(value)
    except ValueError:  # past Python's 4300 digits
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 100 else text[:100] + "..."


def run_tests(code: str, tests: str, time_limit: float = TIME_LIMIT, memory_mb: int = MEMORY_MB) -> tuple[bool, str]:
    """(passed, what the model reads): the code, then the tests, run sealed and judged here."""
    steps, checks = parse_tests(tests)
    limits = sandbox.Limits(seconds=time_limit, memory_mb=memory_mb)
    return verdict(sandbox.run(code, steps, limits), steps, checks, limits)


def passes(prompt: str, completion: str, row: dict) -> float:
    """A reward function (--reward_fn nanochat_ext.tasks.code_tests:passes): 1 if the completion's last python block
    passes the row's tests, run as CodeTests runs them, else 0. One attempt, no feedback: CodeTests in one turn."""
    blocks = CODE_BLOCK.findall(completion)
    return float(run_tests(blocks[-1] if blocks else completion, row["tests"])[0])


class CodeTests:
    """One rollout's attempts at a problem: each assistant turn's code is run against the row's tests. A run gives
    the factory its time_limit: --tool_timeout less a second for the sandbox's start."""

    def __init__(self, row: dict, time_limit: float = TIME_LIMIT):
        if not isinstance(row.get("tests"), str):
            raise InputError("a row needs its tests: Python asserts, as text")
        self.tests, self.time_limit = row["tests"], time_limit
        parse_tests(self.tests)  # tests that do not parse are the row's error now, not a failure of every turn
        self.passed = False

    @classmethod
    def describe(cls) -> str:
        """The run's start line: what isolation the model's code gets on this machine."""
        return f"the model's code runs {sandbox.isolation()}"

    def step(self, reply: str) -> str | None:
        """The failure to fix, as the next user turn; None once every test passes."""
        blocks = CODE_BLOCK.findall(reply)
        self.passed, said = run_tests(blocks[-1] if blocks else reply, self.tests, self.time_limit)
        return None if self.passed else f"The tests failed: {said}. Fix the code."

    def get_reward(self) -> float:
        return float(self.passed)
