"""A rank that stops answering (stopped, deadlocked, stuck in a reward call, killed): the other ranks' collective fails
(gloo times out after --dist_timeout, or sees the connection close), and instead of a backend traceback the run ends
with one line naming the missing ranks, the step and phase, and the checkpoint to resume from. Who is missing is
found by ddp_common's roll call in the group's store; the lowest rank that answered it says the line for all.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanochat_ext.ddp_common import FAILED, HERE
from nanochat_ext.runtime.checkpoint import resumable_checkpoints

EXIT_LOST_RANK = 69  # EX_UNAVAILABLE: a peer is; a restart (torchrun --max-restarts) resumes


@dataclass
class Progress:
    """Where the training loop is, for the line: the steps done so far, of how many, and where checkpoints go."""
    done: int | None = None
    max_steps: int | None = None
    out_dir: Path | None = None

    def clear(self) -> None:
        """A new run in this process (the tests run several) starts knowing nothing."""
        self.done, self.max_steps, self.out_dir = None, None, None


PROGRESS = Progress()


def missing_ranks(e: BaseException) -> list[int]:
    """The ranks that did not answer the roll call after the collective that raised e (ddp_common.dist_session)."""
    return [r for r, answer in getattr(e, "roll_call", {}).items() if answer is None]


def failed_ranks(e: BaseException) -> list[int]:
    """The ranks that answered that they ended with an error of their own (they say its line)."""
    return [r for r, answer in getattr(e, "roll_call", {}).items() if answer == FAILED]


def says_the_line(e: BaseException, rank: int) -> bool:
    """Whether `rank` is the lowest whose collective failed (the ranks that failed by themselves say their own)."""
    return rank == min(r for r, answer in e.roll_call.items() if answer == HERE)


def lost_rank_line(e: BaseException, timeout_s: float) -> str:
    """The missing ranks, the step and phase (memory.doing's) they were lost in, and the checkpoint to resume."""
    missing = missing_ranks(e)
    ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    what = getattr(e, "during", ("",))[0]
    done, last = PROGRESS.done, PROGRESS.max_steps
    where = ("before the first step" if done is None else "after the last step" if done == last else
             f"in step {done + 1}")
    how = (f"no answer within --dist_timeout {timeout_s:g} s" if e.timed_out else "its connection closed") + \
        f", nor to a roll call of {e.roll_call_s:g} s"
    found = resumable_checkpoints(PROGRESS.out_dir) if PROGRESS.out_dir is not None else []
    resume = (f"the newest complete checkpoint is {found[0][0]}: resume with --resume latest" if found else
              "no checkpoint was written yet")
    return f"{ranks} stopped answering {where}{' (' + what + ')' if what else ''}: {how}; {resume}"
