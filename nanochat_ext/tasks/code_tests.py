"""Code checked by tests: the example environment in which the model's code runs (docs/tools.md).

Each prompt row carries "tests": Python asserts, as MBPP writes them (`assert add(2, 3) == 5`). After each assistant
turn the environment takes the turn's last ```python block (or the whole turn, where it has none) and runs it sealed
(sandbox/sandbox.py: its own namespaces where the OS allows them, no network, the filesystem read-only but its own
directory, limits on time, memory, files and processes, every process it starts ended with it), then the tests in
order. The verdict is made here, not by the code's process (tasks/code_checks.py): only the values of the code's own
names (a call `f(2)`, `f(x)[0]`) come back from the sandbox, as plain data of exact types, and the rest of each
assert (the literal, `abs(... - 12.566) < 0.001`, `math.isclose(...)`, `sorted(...)`) is evaluated here, so nothing
of the code's (an `__eq__`, a patched `math`) takes part. Exiting early by any route, patching the tests, writing on
the results pipe or killing its own process all leave a test without its value: a failure. Tests that would be
judged in the code's reach (an assert over a name the tests' own statements define, a lambda or comprehension) are
refused when the row is read.

The environment answers with the first failure (what a test's expression gave, never what it should have given) so
that the model can try again, and ends the episode when every test passes. Its reward is 1 if they passed, else 0.

    python -m scripts.kat_train_grpo --policy ... --prompts problems.jsonl \
        --env nanochat_ext.tasks.code_tests:CodeTests --max_turns 3
"""
from __future__ import annotations

import re
from typing import Any

from nanochat_ext.errors import InputError, Unscored
from nanochat_ext.sandbox import sandbox
from nanochat_ext.tasks.code_checks import Judged, Plan, Unjudged, parse_tests

TIME_LIMIT = 5.0  # seconds of wall clock (and of CPU) a run may take, where the run gives no --tool_timeout
MEMORY_MB = 512  # address space a process of the run may map
CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def verdict(run: sandbox.Run, plan: Plan, limits: sandbox.Limits) -> tuple[bool, str]:
    """(passed, what the model reads): every assert's probes came back and the assert holds, else the first
    failure. Never raises, whatever the code's process gave or died of."""
    n = len(plan.asserts)
    if not run.ran:
        return False, f"the sandbox could not run the code ({run.sealed})"
    if 0 in run.errors:
        return False, f"the code {run.errors[0]}"
    failed_statement = next((k for k, (kind, _, _) in enumerate(plan.steps, 1) if kind == "exec" and k in run.errors),
                            None)
    for judge, probe_steps in plan.asserts:
        name = plan.steps[probe_steps[0] - 1][2]
        if failed_statement is not None and failed_statement < probe_steps[0]:
            return False, f"the tests' statement `{plan.steps[failed_statement - 1][1][:60]}`: " \
                          f"{run.errors[failed_statement]}"
        said = judge_one(run, judge, probe_steps, f"{name} of {n}", limits)
        if said is not None:
            return False, said
    if run.garbled:
        return False, f"the tests' results could not be read: the code {run.garbled}"
    return True, "all tests passed"


def judge_one(run: sandbox.Run, judge: Judged, probe_steps: list[int], where: str, limits: sandbox.Limits
              ) -> str | None:
    """Why one assert failed, or None where it holds."""
    values: list[Any] = []
    for probe, k in zip(judge.probes, probe_steps):
        if k in run.errors:
            values.append(Unjudged(f"{where}: {probe[:80]} {run.errors[k]}"))
        elif k in run.values:
            values.append(run.values[k])
        else:
            values.append(Unjudged(f"the code's process ended ({run.ended(limits)}) before {where} gave its value"))
    gave = "; ".join(f"{p[:80]} gave {shown(v)}" for p, v in zip(judge.probes, values) if not isinstance(v, Unjudged))
    try:
        if judge.holds(values):
            return None
    except Unjudged as e:
        return str(e) if e in values else f"{where}: `{judge.source[:80]}`: {e}"
    except Exception as e:  # a comparison of unlike types (TypeError), as the assert itself would raise
        if len(values) == 1:
            return f"{where}: {gave}, which cannot be compared ({type(e).__name__})"
        return f"{where}: `{judge.source[:80]}` raised {type(e).__name__} ({gave})"
    if judge.alone:
        return f"{where}: {judge.probes[0][:80]} was {str(judge.negated).lower()}"
    return f"{where}: {gave}" if len(values) == 1 else f"{where}: `{judge.source[:80]}` was false ({gave})"


def shown(value: Any) -> str:
    """A value the code gave, as the model reads it: its repr, cut (where it has none, e.g. past Python's 4300
    digits, its type)."""
    try:
        text = repr(value)
    except Exception:  # an int too long to print, inside a list too
        return f"an int of {value.bit_length()} bits" if type(value) is int else f"a {type(value).__name__} too " \
                                                                                 f"large to print"
    return text if len(text) <= 100 else text[:100] + "..."


def run_tests(code: str, tests: str, time_limit: float = TIME_LIMIT, memory_mb: int = MEMORY_MB) -> tuple[bool, str]:
    """(passed, what the model reads): the code, then the tests, run sealed and judged here. Unscored where the
    sandbox failed to start (twice): the machine's failure, not the code's."""
    plan = parse_tests(tests)
    limits = sandbox.Limits(seconds=time_limit, memory_mb=memory_mb)
    run = sandbox.run(code, plan.steps, limits)
    if run.failed_to_start:
        raise Unscored(f"the sandbox failed to start twice ({run.sealed[:200]})")
    return verdict(run, plan, limits)


def passes(prompt: str, completion: str, row: dict) -> float:
    """A reward function (--reward_fn nanochat_ext.tasks.code_tests:passes): 1 if the completion's last python block
    passes the row's tests, run as CodeTests runs them, else 0. One attempt, no feedback: CodeTests in one turn."""
    blocks = CODE_BLOCK.findall(completion)
    return float(run_tests(blocks[-1] if blocks else completion, row["tests"])[0])


class CodeTests:
    """One rollout's attempts at a problem: each assistant turn's code is run against the row's tests. A run gives
    the factory its time_limit: --tool_timeout less a second for the sandbox's end and the verdict (the wait for a
    slot and the sandbox's start are not the call's time)."""

    def __init__(self, row: dict, time_limit: float = TIME_LIMIT):
        if not isinstance(row.get("tests"), str):
            raise InputError("a row needs its tests: Python asserts, as text")
        if (why := sandbox.broken()) is not None:
            raise InputError(f"the model's code cannot run on this machine: {why}")
        self.tests, self.time_limit = row["tests"], time_limit
        parse_tests(self.tests)  # tests that do not parse are the row's error now, not a failure of every turn
        self.passed, self.unscored = False, ""

    @classmethod
    def describe(cls) -> str:
        """The run's start line: what isolation the model's code gets on this machine."""
        return f"the model's code runs {sandbox.isolation()}"

    def step(self, reply: str) -> str | None:
        """The failure to fix, as the next user turn; None once every test passes (or the sandbox failed to start:
        the episode ends, and its reward is Unscored)."""
        blocks = CODE_BLOCK.findall(reply)
        try:
            self.passed, said = run_tests(blocks[-1] if blocks else reply, self.tests, self.time_limit)
        except Unscored as e:
            self.unscored, self.passed = str(e), False
            return None
        return None if self.passed else f"The tests failed: {said}. Fix the code."

    def get_reward(self) -> float:
        if self.unscored:
            raise Unscored(self.unscored)
        return float(self.passed)
