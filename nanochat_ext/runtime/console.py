"""What a run prints, on its way to the user. While a run lasts (session.run), its sys.stdout and sys.stderr are
RunOutput streams over the real ones:

- A closed stdout or stderr ends neither the run nor its checkpoint. `torchrun ... 2>&1 | tee log`, then Ctrl-C: the
  terminal's SIGINT ends tee too, and the ranks' next lines (the signal's own) meet a pipe with no reader. The first
  write that finds the reader gone points that file descriptor at /dev/null, so what the run writes after it (Python's
  lines, torch's C++ warnings, the interpreter's last flush at exit) goes nowhere instead of raising; the run finishes
  its step, checkpoints and exits as it would have.
- Every line also goes to <log_dir>/console.log (each rank's, appended whole: the terminal's lines, in one file) once
  the run has claimed its --out (outdir.claim_out_dir); the lines printed before that are kept until then. So no pipe
  is needed to keep a run's log, and a run that stops on bad input before claiming --out writes no file.
- A progress bar on the terminal (the Tracker's) is cleared before a line is written and drawn after it, so a line
  printed beside the bar is never written over.

Lines go through whole: the text of a write is held until its newline, then written in one call, so ranks that share
torchrun's pipe cannot interleave inside a line (a pipe's writes of up to PIPE_BUF bytes are atomic).
"""
from __future__ import annotations

import errno
import io
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

LOG_NAME = "console.log"
EARLY_LINES = 10_000  # lines kept before the log dir is known (a run prints a few dozen there)


class Console:
    """One run's console: its two RunOutput streams, the bar they clear, and the file they keep lines in."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the rollout thread prints too
        self.early: list[str] = []
        self.log: int | None = None  # console.log's descriptor, opened for appending
        self.bar: Any = None  # a tqdm bar drawn on the terminal
        self.streams: list[RunOutput] = []

    def keep(self, line: str) -> None:
        if self.log is None:
            if len(self.early) < EARLY_LINES:
                self.early.append(line)
            return
        try:
            os.write(self.log, line.encode("utf-8", "replace"))
        except OSError:  # a full disk stops the copy, not the run
            self.close_log()

    def keep_in(self, log_dir: Path, header: str) -> None:
        with self.lock:
            if self.log is not None:
                return
            try:
                self.log = os.open(log_dir / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError:
                return
            early, self.early = self.early, []
            for line in ([header] if header else []) + early:
                self.keep(line)

    def close_log(self) -> None:
        if self.log is not None:
            os.close(self.log)
        self.log = None


class RunOutput(io.TextIOBase):
    """sys.stdout or sys.stderr during a run: the module docstring."""

    def __init__(self, inner: TextIO, console: Console):
        self.inner, self.console, self.pending = inner, console, ""
        self.busy: int | None = None  # the thread in write or flush (a signal handler's line in it: written directly)

    def write(self, text: str) -> int:
        if self.busy == threading.get_ident():  # a signal handler's print amid this thread's write: its line, now
            self.console.keep(text)
            self._guarded(lambda: os.write(self.inner.fileno(), text.encode("utf-8", "replace")))
            return len(text)
        with self.console.lock:
            self.busy = threading.get_ident()
            try:
                self.pending += text
                if "\n" in self.pending:
                    cut = self.pending.rindex("\n") + 1
                    lines, self.pending = self.pending[:cut], self.pending[cut:]
                    self._out(lines)
            finally:
                self.busy = None
        return len(text)

    def flush(self) -> None:
        if self.busy == threading.get_ident():
            return
        with self.console.lock:
            self.busy = threading.get_ident()
            try:
                if self.pending:
                    text, self.pending = self.pending, ""
                    self._out(text)
                self._guarded(self.inner.flush)
            finally:
                self.busy = None

    def _out(self, text: str) -> None:
        self.console.keep(text)
        bar = self.console.bar
        _drawn(bar, "clear")
        self._guarded(lambda: (self.inner.write(text), self.inner.flush()))
        _drawn(bar, "refresh")

    def _guarded(self, write) -> None:
        """write(), or where the stream's reader is gone, its descriptor pointed at /dev/null and the text dropped."""
        try:
            write()
        except BrokenPipeError:
            self._reader_gone()
        except ValueError:  # the stream object closed; anything else (an encoding error) is the caller's
            if not getattr(self.inner, "closed", False):
                raise
            self._reader_gone()
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self._reader_gone()

    def _reader_gone(self) -> None:
        try:
            fd = self.inner.fileno()
        except (AttributeError, OSError, ValueError):
            return
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        try:  # what the stream still holds goes to /dev/null now
            self.inner.flush()
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return self.inner.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")


def _drawn(bar: Any, how: str) -> None:
    """The bar cleared or drawn again around a line; a bar that cannot draw (its terminal gone) is not the line's
    stream's concern."""
    if bar is not None:
        try:
            getattr(bar, how)(nolock=True)
        except (OSError, ValueError):
            pass


_current: Console | None = None
_depth = 0  # runs started and not ended: a run called inside another (nanochat_ext.api in a run) keeps the outer's


def start() -> None:
    """A run starts: its stdout and stderr become RunOutput streams."""
    global _current, _depth
    _depth += 1
    if _current is not None:
        return
    _current = Console()
    sys.stdout, sys.stderr = RunOutput(sys.stdout, _current), RunOutput(sys.stderr, _current)
    _current.streams = [sys.stdout, sys.stderr]


def keep_in(log_dir: Path, rank: int) -> None:
    """The run's lines go to log_dir/console.log from now on, the earlier ones first; rank 0 heads them with the run's
    start (a resumed run appends to the same file)."""
    if _current is not None:
        header = f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n" if rank == 0 else ""
        _current.keep_in(Path(log_dir), header)


def terminal() -> TextIO:
    """The stderr the run found, for a progress bar to draw on (its frames are not lines to keep)."""
    return _current.streams[1].inner if _current is not None else sys.stderr


def show_bar(bar: Any) -> None:
    """The tracker's bar (None: no bar): lines are written around it."""
    if _current is not None:
        _current.bar = bar


def end() -> None:
    """The run ends: what is pending is written, console.log closed, the streams the run found put back."""
    global _current, _depth
    _depth = max(0, _depth - 1)
    if _current is None or _depth:
        return
    console, _current = _current, None
    out, err = console.streams
    try:
        for stream in (out, err):
            stream.flush()
    finally:  # a stream that cannot flush (a full disk under `> file`) still goes back, the log still closes
        with console.lock:
            console.close_log()
        if sys.stdout is out:
            sys.stdout = out.inner
        if sys.stderr is err:
            sys.stderr = err.inner
