"""Where a run is, for the line a failure ends it with: the steps done of how many, where its checkpoints go, and the
phase it was in (a rollout, a training micro-batch, the optimizer step) with the flags that take less memory there.
One Progress per run, made by the session (runtime/session.py) and handed to what trains; nothing module-global.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


class Phase(NamedTuple):
    """What ran (for the line: 'out of memory in <what>'), the flags that take less memory in it, and whether this
    step's checkpoint was already written (as before the final evaluation)."""
    what: str
    hints: tuple[str, ...] = ()
    saved: bool = False


@dataclass
class Progress:
    done: int | None = None  # steps done so far (None: before the first step)
    max_steps: int | None = None
    out_dir: Path | None = None
    _failed: tuple[BaseException, Phase] | None = field(default=None, repr=False)

    @contextlib.contextmanager
    def doing(self, what: str, hints: tuple[str, ...] = (), saved: bool = False) -> Iterator[None]:
        """Name the phase that runs inside: an error raised in it is recorded with the innermost phase's (phase_of)."""
        try:
            yield
        except BaseException as e:
            if self._failed is None or self._failed[0] is not e:
                self._failed = (e, Phase(what, hints, saved))
            raise

    def phase_of(self, e: BaseException) -> Phase | None:
        """The innermost phase `e` (or an error it was raised from) came out of; None: outside every phase."""
        if self._failed is None:
            return None
        seen = set()
        while e is not None and id(e) not in seen:
            if e is self._failed[0]:
                return self._failed[1]
            seen.add(id(e))
            e = e.__cause__ or e.__context__
        return None
