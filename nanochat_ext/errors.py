"""The one error type for bad input. Scripts catch it, print one line, and exit non-zero."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Row(int):
    """A record's number in a table (a parquet or Arrow file, a datasets directory): where an error is, said as
    'row N' rather than a JSONL file's ':N'. An int everywhere else."""


class InputError(Exception):
    """Bad user input: a file, a line, a field, a flag. The message says which."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None, field: str | None = None):
        where = ""
        if path is not None:
            at = "" if line is None else f": row {line}" if isinstance(line, Row) else f":{line}"
            where = f"{path}{at}: "
        what = f"field '{field}': " if field is not None else ""
        super().__init__(where + what + message)
        self.path, self.line, self.field = path, line, field
        self.collective = False  # raised on every rank by ddp_common.raise_if_any


@contextlib.contextmanager
def from_outside(what: str, path: object) -> Iterator[None]:
    """The boundary where a third-party loader (transformers, tokenizers, safetensors) reads a file from outside:
    whatever it raises for a broken one (truncated or missing weights, a config that does not parse or does not
    fit the weights, a file of another kind) becomes one line naming the path."""
    try:
        yield
    except (InputError, MemoryError, torch.OutOfMemoryError):  # out of memory is not a broken file
        raise
    except Exception as e:
        raise InputError(f"{what} does not load ({first_line(e)})", path=str(path)) from None


def first_line(e: BaseException, limit: int = 200) -> str:
    """'Type: first line of the message', cut to `limit` characters: a third-party error in one line."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"
