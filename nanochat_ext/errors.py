"""The one error type for bad input, and every exit code a script ends with. Scripts catch it, print one line, and
exit non-zero."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Every way a script ends but success (0), each with its one line (runtime/session.py says it).
EXIT_UNFORESEEN = 1  # a bug or an environment failure: its traceback, then the line
EXIT_BAD_INPUT = 2  # a file, row, field or flag: the line names it; nothing was written
EXIT_NONFINITE = 3  # a step's loss or gradient was not finite: stopped before its optimizer step, nothing saved
EXIT_OUT_OF_MEMORY = 4  # bad input too (a model or batch too big): the line says in what and which flags take less
EXIT_LOST_RANK = 69  # EX_UNAVAILABLE: a peer stopped answering; a restart (torchrun --max-restarts) resumes
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: SIGTERM/SIGINT, checkpointed; try again with --resume latest


class Row(int):
    """A record's number in a table (a parquet or Arrow file, a datasets directory): where an error is, said as
    'row N' rather than a JSONL file's ':N'. An int everywhere else."""


class Index(int):
    """A record's index in rows given in Python (a list of dicts, a datasets.Dataset: nanochat_ext.api), said as
    '[i]', as Python indexes them."""


def located(path: object, line: int | None) -> str:
    """A record as its user numbers it: 'prompts.jsonl:15' (a line), 'prompts.parquet: row 15' (a Row), 'prompts: a
    list of 64 rows[14]' (an Index into rows given in Python), or the path alone."""
    at = "" if line is None else f": row {line}" if isinstance(line, Row) else f"[{line}]" \
        if isinstance(line, Index) else f":{line}"
    return f"{path}{at}"


class InputError(Exception):
    """Bad user input: a file, a line, a field, a flag. The message says which."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None, field: str | None = None):
        where = f"{located(path, line)}: " if path is not None else ""
        what = f"field '{field}': " if field is not None else ""
        super().__init__(where + what + message)
        self.path, self.line, self.field = path, line, field
        self.collective = False  # raised on every rank by ddp_common.raise_if_any


class Unscored(Exception):
    """A reward that could not be computed for reasons outside the answer (the machine's: a sandbox that failed to
    start twice). Raised by a reward function or an environment's get_reward(): the completion is not scored 0 but
    left out of the loss, with its group (train/sandbox_failures counts such completions)."""


class RunFailed(Exception):
    """A run started in Python (nanochat_ext.api) that ended as a script would with exit code `code`: its one line
    was said on stderr, as a script's is, and is this exception's message too (`why`); raised from what ended the
    run, so that a user's function that raised shows its own traceback in the chain."""

    def __init__(self, trainer: str, code: int, why: str = ""):
        super().__init__(f"{trainer} ended with exit code {code}" + (f": {why}" if why else
                                                                     " (docs/reliability.md#exit-codes)"))
        self.code = code


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
