"""What a run prints (runtime/console.py): whole lines, a progress bar written around, a closed pipe outlived, every
line kept in console.log from the run's start. The end-to-end case (Ctrl-C through `| tee` on 1 and 2 ranks, the
checkpoint written and resumed exactly) is test_reliability's."""
from __future__ import annotations

import io
import os
import sys

from nanochat_ext.runtime import console


class Bar:
    """A tqdm bar's two calls the console makes, recorded in order with what the terminal held then."""

    def __init__(self, terminal: io.StringIO, calls: list):
        self.terminal, self.calls = terminal, calls

    def clear(self, nolock: bool = False) -> None:
        self.calls.append(("clear", self.terminal.getvalue()))

    def refresh(self, nolock: bool = False) -> None:
        self.calls.append(("refresh", self.terminal.getvalue()))


def test_lines_go_out_whole_around_the_bar_and_into_the_log_from_the_start(tmp_path, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console.start()
    try:
        print("data: 8 rows", flush=True)  # before --out is claimed: kept until then
        calls: list = []
        console.show_bar(Bar(out, calls))
        sys.stdout.write("dp: trainable ")
        assert out.getvalue() == "data: 8 rows\n" and calls == []  # half a line waits for its end
        sys.stdout.write("parameters identical on 2 ranks\n")
        assert calls == [("clear", "data: 8 rows\n"), ("refresh", "data: 8 rows\ndp: trainable parameters identical "
                                                                   "on 2 ranks\n")]  # the line between the two
        console.keep_in(tmp_path, rank=0)
        print("error: a line on stderr", file=sys.stderr)
        console.show_bar(None)
    finally:
        console.end()
    assert sys.stdout is out and sys.stderr is err  # the streams the run found, put back
    head, *lines = (tmp_path / "console.log").read_text().splitlines()
    assert head.startswith("== ") and lines == ["data: 8 rows", "dp: trainable parameters identical on 2 ranks",
                                                "error: a line on stderr"]


def test_a_pipe_whose_reader_is_gone_takes_the_runs_lines_without_a_word(tmp_path, monkeypatch):
    """`| tee` ended by the same Ctrl-C: the first line that meets the closed pipe points the descriptor at /dev/null,
    and everything after (Python's lines, a raw write to the descriptor, the last flush) goes there quietly; the
    log keeps every line."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone
    stream = open(write, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", stream)
    console.start()
    try:
        console.keep_in(tmp_path, rank=1)  # another rank: no head line
        print("signal: SIGINT; finishing this step", file=sys.stderr, flush=True)
        print("interrupted at step 7", file=sys.stderr)
        os.write(stream.fileno(), b"a C++ warning\n")  # raises BrokenPipeError unless the fd was pointed elsewhere
    finally:
        console.end()
    stream.write("the interpreter's last flush\n")
    stream.flush()
    stream.close()
    assert (tmp_path / "console.log").read_text() == "signal: SIGINT; finishing this step\ninterrupted at step 7\n"


class HandlerFiresInWrite:
    """A stream over a pipe whose first write is interrupted by a signal handler that prints a line (guard.py's), as
    SIGINT can land while the run is writing one; a write that cannot encode raises as a real stream would."""

    def __init__(self, fd: int):
        self.fd, self.fired = fd, False

    def fileno(self) -> int:
        return self.fd

    def write(self, text: str) -> int:
        if "\udcff" in text:
            raise UnicodeEncodeError("utf-8", text, 0, 1, "surrogates not allowed")
        if not self.fired:
            self.fired = True
            print("signal: SIGINT; finishing this step", file=sys.stderr, flush=True)
        return os.write(self.fd, text.encode())

    def flush(self) -> None:
        pass


def test_a_signal_handlers_line_amid_a_write_goes_out_whole_and_an_encoding_error_is_not_a_closed_pipe(tmp_path,
                                                                                                       monkeypatch):
    read, write = os.pipe()
    monkeypatch.setattr(sys, "stderr", HandlerFiresInWrite(write))
    console.start()
    try:
        console.keep_in(tmp_path, rank=1)
        print("grpo step 3 | train/reward 0.5", file=sys.stderr, flush=True)
        try:
            print("a reply \udcff", file=sys.stderr, flush=True)
        except UnicodeEncodeError:
            pass
        else:
            raise AssertionError("an encoding error was taken for a closed pipe")
        print("grpo step 4 | train/reward 0.6", file=sys.stderr, flush=True)
    finally:
        console.end()
    os.close(write)
    with os.fdopen(read) as f:  # the descriptor still the pipe's: nothing pointed at /dev/null
        assert f.read() == "signal: SIGINT; finishing this step\ngrpo step 3 | train/reward 0.5\n" \
                           "grpo step 4 | train/reward 0.6\n"
