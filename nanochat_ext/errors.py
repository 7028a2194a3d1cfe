"""The one error type for bad input. Scripts catch it, print one line, and exit non-zero."""
from __future__ import annotations


class InputError(Exception):
    """Bad user input: a file, a line, a field, a flag. The message says which."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None, field: str | None = None):
        where = ""
        if path is not None:
            where = str(path) + (f":{line}" if line is not None else "") + ": "
        what = f"field '{field}': " if field is not None else ""
        super().__init__(where + what + message)
        self.path, self.line, self.field = path, line, field
        self.collective = False  # raised on every rank by ddp_common.raise_if_any


def first_line(e: BaseException, limit: int = 200) -> str:
    """'Type: first line of the message', cut to `limit` characters: a third-party error in one line."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"
