"""Time a call spends waiting for what other calls hold (a sandbox's slot, its start on a loaded machine), which the
call's timeout does not count: a row's answer is judged on its own time, never on its neighbours' or the machine's.

The caller of a timed call gives the thread that runs it a Waits (`Waits.attach`); code deep inside the call marks its
waits (`with not_counted(): ...`), and the caller's deadline moves by what was waited (`waited()`, a wait still going
on included). Outside an attached thread, not_counted() does nothing.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


class Waits:
    """One call's waits so far, read by its caller while the call runs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.total = 0.0
        self.since: float | None = None  # when the wait going on began
        self.depth = 0

    def attach(self) -> None:
        """Make this the running thread's Waits (the call's thread calls it first)."""
        _local.waits = self

    def waited(self) -> float:
        with self.lock:
            return self.total + (time.monotonic() - self.since if self.since is not None else 0.0)

    def begin(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                self.since = time.monotonic()

    def end(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.since is not None:
                self.total += time.monotonic() - self.since
                self.since = None


class Pause:
    """A wait of the running thread's call, ended by end() (once; later calls do nothing) or at the with's end."""

    def __init__(self):
        self.waits: Waits | None = getattr(_local, "waits", None)
        if self.waits is not None:
            self.waits.begin()

    def end(self) -> None:
        if self.waits is not None:
            self.waits.end()
            self.waits = None


@contextmanager
def not_counted() -> Iterator[Pause]:
    pause = Pause()
    try:
        yield pause
    finally:
        pause.end()
