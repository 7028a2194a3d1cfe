"""Tools and environments the agent tests pass as --tools tools_for_tests:<name> and --env."""
import time
from typing import Literal

from nanochat_ext.tasks import multiplication
from nanochat_ext.tasks.code_tests import CodeTests


def multiply(a: int, b: int) -> int:
    # What it does differs from nanochat_ext.tasks.multiplication's where a says: 12 raises, 7 hangs, 25 returns no
    # JSON. Its docstring, so its schema, is that tool's (below): tests/fixtures/hf-tool-use memorised its prompt.
    if a == 12:
        raise ValueError("twelve is unlucky")
    if a == 7:
        time.sleep(30)
    if a == 25:
        return object()
    return a * b


multiply.__doc__ = multiplication.multiply.__doc__


def undocumented(a: int) -> int:
    return a


def untyped(a):
    """Returns a.

    Args:
        a: Anything.
    """
    return a


class CountingGame:
    """An environment that asks for one more turn twice, then ends, and gives the number of turns it saw."""

    def __init__(self, row: dict):
        self.seen = []

    def step(self, reply: str):
        self.seen.append(reply)
        return None if len(self.seen) == 3 else {"role": "user", "content": f"again {len(self.seen)}"}

    def get_reward(self) -> float:
        return float(len(self.seen))


class BrokenGame:
    """Answers junk, then raises."""

    def __init__(self, row: dict):
        self.turns = 0

    def step(self, reply: str):
        self.turns += 1
        if self.turns == 1:
            return 42
        raise RuntimeError("the board fell over")


def lookup(key: str, default: int | str | None = 0) -> str:
    """Looks a key up.

    Args:
        key: What to look up.
        default: What to answer where the key is unknown, a number, a text or nothing.
    """
    return f"{key}: {default}"


class QuietGame:
    """Ends every episode at its first turn by answering no turns ([]); its factory fails for a row with "fail"."""

    def __init__(self, row: dict):
        if row.get("fail"):
            raise KeyError("fail")
        self.seen = []

    def step(self, reply: str):
        self.seen.append(reply)
        return []

    def get_reward(self) -> float:
        return 1.0


def paint(color: Literal["red", "blue"], sizes: list[int]) -> str:
    """Paints.

    Args:
        color: Which color.
        sizes: The sizes to paint.
    """
    return f"{color} {sizes}"


LATE_STEPS: list[str] = []  # what SlowGame's steps saw, each appended when its step ends (a late one too)


class SlowGame:
    """Its first step outlasts any short --tool_timeout (0.6 s), then records what it saw; it would answer again."""

    def __init__(self, row: dict):
        self.steps = 0

    def step(self, reply: str):
        self.steps += 1
        if self.steps == 1:
            time.sleep(0.6)
        LATE_STEPS.append(reply)
        return "again"

    def get_reward(self) -> float:
        LATE_STEPS.append("get_reward")
        return 1.0


class MeddlingGame:
    """A factory that changes the row it is given, nested fields included."""

    def __init__(self, row: dict):
        row["meta"]["seen"] += 1
        row["prompt"] = "changed"

    def step(self, reply: str):
        return None


class RowsCode(CodeTests):
    """CodeTests that runs the row's own `code` (a stand-in for what a policy wrote: hostile, looping or a solution)
    whatever the model replied; a row of case 'text' gives text for its reward, not a number."""

    def __init__(self, row: dict, time_limit: float = 1.0):
        super().__init__(row, time_limit)
        self.code, self.case = row["code"], row["case"]

    def step(self, reply: str) -> str | None:
        return super().step(f"```python\n{self.code}\n```")

    def get_reward(self):
        return "0.75" if self.case == "text" else super().get_reward()
