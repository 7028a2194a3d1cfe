"""Tools and environments the agent tests pass as --tools tools_for_tests:<name> and --env."""
import time

from nanochat_ext.tasks import multiplication


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
