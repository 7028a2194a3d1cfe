"""A rank that stops answering (stopped, deadlocked, stuck in a reward call, killed): the other ranks' collective fails
(gloo times out after --dist_timeout, or sees the connection close), and instead of a backend traceback the run ends
with one line naming the missing ranks, the step and phase, and the checkpoint to resume from. Who is missing is
found by a roll call in the group's store, which answers when the group does not; the lowest rank that answered it
says the line for all.
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from nanochat_ext.ddp_common import get_rank, get_world_size
from nanochat_ext.runtime.checkpoint import resumable_checkpoints
from nanochat_ext.runtime.progress import Progress

ROLL_CALL_MAX_S = 30.0  # after a timeout: ranks reach the roll call as far apart as they entered the collective
PEER_GONE_S = 2.0  # after a closed connection: every rank that held one to the dead peer learns at once
HERE, FAILED = "here", "failed"  # a rank's answer to the roll call: its collective failed, or it raised its own error
ROLL_CALL_KEY = "nanochat_ext/roll_call/{}"  # under the group's prefix: one roll call per start


class LostRanks(Exception):
    """A collective failed because a peer did not take part; `answers`: each rank's answer to the roll call that
    followed (HERE, FAILED, or None for one that did not answer), {} when the store itself did not answer."""

    def __init__(self, answers: dict[int, str | None], timed_out: bool, grace_s: float):
        super().__init__(f"a collective failed; roll call: {answers}")
        self.answers, self.timed_out, self.grace_s = answers, timed_out, grace_s

    @property
    def missing(self) -> list[int]:
        """The ranks that did not answer the roll call."""
        return [r for r, answer in self.answers.items() if answer is None]

    @property
    def failed(self) -> list[int]:
        """The ranks that answered that they ended with an error of their own (they say its line)."""
        return [r for r, answer in self.answers.items() if answer == FAILED]

    def says_the_line(self, rank: int) -> bool:
        """Whether `rank` is the lowest whose collective failed (the ranks that failed by themselves say their own)."""
        return rank == min(r for r, answer in self.answers.items() if answer == HERE)


def roll_call_grace(e: BaseException, timeout_s: float) -> float:
    """How long the roll call after e waits for the others: a quarter of the collective timeout (at most
    ROLL_CALL_MAX_S) after a timeout, PEER_GONE_S after a peer's connection closed (its process is gone, and under
    torchrun its agent is already stopping the others)."""
    grace = min(ROLL_CALL_MAX_S, timeout_s / 4)
    return grace if "timed out" in str(e).lower() else min(PEER_GONE_S, grace)


def sign_in(answer: str) -> None:
    """Answer the roll call in the group's store (best effort: a store that does not answer cannot be told)."""
    try:
        dist.distributed_c10d._get_default_store().set(ROLL_CALL_KEY.format(get_rank()), answer)
    except Exception:  # the store's own errors, or none left to reach
        pass


def is_collective_failure(e: BaseException) -> bool:
    """A collective that failed because a peer did not take part: torch's distributed errors (NCCL's, the store's)
    and gloo's transport errors (a timeout, a connection closed or reset), which it raises as RuntimeError."""
    gloo = isinstance(e, RuntimeError) and "gloo/transport" in str(e)
    return dist.is_available() and dist.is_initialized() and (isinstance(e, dist.DistError) or gloo)


def roll_call(grace_s: float) -> dict[int, str | None]:
    """Collective through the group's store: sign in and wait up to grace_s for every rank to. Returns each rank's
    answer (HERE, FAILED) or None for one that did not answer (stuck where it was, or gone); {} when the store itself
    does not answer (it lives in rank 0 where no launcher's agent holds it)."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + grace_s
    try:
        store.set_timeout(datetime.timedelta(seconds=grace_s))
        store.set(ROLL_CALL_KEY.format(get_rank()), HERE)
        while True:
            keys = {r: ROLL_CALL_KEY.format(r) for r in range(get_world_size())}
            answered = {r: store.check([k]) for r, k in keys.items()}
            if all(answered.values()) or time.monotonic() > deadline:
                return {r: store.get(keys[r]).decode() if answered[r] else None for r in keys}
            time.sleep(0.05)
    except Exception:  # the store's own errors, or none left to reach: no one can be named
        return {}


def lost_ranks(e: BaseException, timeout_s: float) -> LostRanks:
    """Collective, while the group's store is there: the roll call after the collective failure e."""
    grace = roll_call_grace(e, timeout_s)
    return LostRanks(roll_call(grace), "timed out" in str(e).lower(), grace)


def lost_rank_line(e: LostRanks, progress: Progress, timeout_s: float) -> str:
    """The missing ranks, the step and phase they were lost in, and the checkpoint to resume."""
    missing = e.missing
    ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    phase = progress.phase_of(e)
    what = phase.what if phase else ""
    done, last = progress.done, progress.max_steps
    where = ("before the first step" if done is None else "after the last step" if done == last else
             f"in step {done + 1}")
    how = (f"no answer within --dist_timeout {timeout_s:g} s" if e.timed_out else "its connection closed") + \
        f", nor to a roll call of {e.grace_s:g} s"
    found = resumable_checkpoints(progress.out_dir) if progress.out_dir is not None else []
    resume = (f"the newest complete checkpoint is {found[0][0]}: resume with --resume latest" if found else
              "no checkpoint was written yet")
    return f"{ranks} stopped answering {where}{' (' + what + ')' if what else ''}: {how}; {resume}"
