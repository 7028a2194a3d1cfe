"""A script's run from start to exit code: the process group (always torn down), the one line every failure ends with
and its exit code (errors.py's table), and what a torchrun restart is told of how the previous start ended.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from nanochat_ext.config import option
from nanochat_ext.ddp_common import DistEnv, agent_store, detect_launcher, dist_session, restart_attempt
from nanochat_ext.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_LOST_RANK,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    EXIT_UNFORESEEN,
    InputError,
    first_line,
)
from nanochat_ext.runtime import console, process_state
from nanochat_ext.runtime.guard import Interrupted, NonFiniteError, restore_signal_handlers
from nanochat_ext.runtime.oom import is_out_of_memory, out_of_memory_line
from nanochat_ext.runtime.outdir import release_out_dirs
from nanochat_ext.runtime.peers import FAILED, LostRanks, is_collective_failure, lost_rank_line, lost_ranks, sign_in
from nanochat_ext.runtime.progress import Progress

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class SessionConfig:
    """Where a script runs and how its ranks talk."""
    device: str = option("auto", "auto: the GPU of this rank where CUDA is available, else the CPU", choices=DEVICES)
    backend: str | None = option(None, "process-group backend (default: nccl on CUDA, gloo on CPU). Given explicitly, "
                                       "a one-process run creates the group too, so one GPU runs the whole distributed "
                                       "path")
    dist_timeout: float = option(1800.0, "collective timeout, seconds",
                                 check=(lambda v: 0 < v < float("inf"), "a finite number of seconds > 0"))


@dataclass(frozen=True)
class Session:
    """What a script's body runs in: its rank's place in the process group, and where the run is (for the line a
    failure ends it with)."""
    env: DistEnv
    progress: Progress


last_failure: BaseException | None = None  # what ended the last run() of this process, for nanochat_ext.api to chain
last_line = ""  # the line the last run() of this process ended with ('' on success), for nanochat_ext.api's message
# Endings a restart would meet again (torchrun restarts after any failure): the next start ends at once with the line.
ENDINGS_THAT_REPEAT = (EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY)
# Endings whose line every rank may reach alike, said once (first_to_say); an unforeseen error's line follows each
# rank's own traceback, and a lost rank's line is said by one rank already.
SAID_ONCE = (EXIT_BAD_INPUT, EXIT_OUT_OF_MEMORY)
_runs = 0  # the runs this process has started (first_to_say's key: a second run's same line is said again)


def run(config: SessionConfig, body: Callable[[Session], object], label: str, *, group: bool = False,
        given: dict | None = None) -> int:
    """Run body(session) inside a process-group session that is always torn down (group: make one even for one rank,
    as FSDP needs); rank 0 prints `<label>: <what body returned>` as the last line. A failure ends with one
    `error: ...` line, the last on stderr (said once under torchrun for bad input or an out of memory the ranks share,
    else by rank 0 for an error they agree on, or by each failing rank), and
    an exit code: EXIT_BAD_INPUT for bad input, EXIT_NONFINITE, EXIT_INTERRUPTED (SIGTERM/SIGINT, checkpointed),
    EXIT_OUT_OF_MEMORY (one line on every rank that ran out, saying which of the `given` flags to change),
    EXIT_LOST_RANK (a rank stopped answering: one line naming it) or EXIT_UNFORESEEN (after its traceback). Under
    torchrun a start that follows one ending in ENDINGS_THAT_REPEAT ends at once with that line."""
    rank, timeout_s = detect_launcher()[1], config.dist_timeout
    ending = Ending(rank, datetime.timedelta(seconds=timeout_s))
    if (ended := previous_ending(ending.timeout)) is not None:
        return ending(*ended, again=" (torchrun's previous start ended so; not run again)")
    global last_failure, last_line, _runs
    progress, last_failure, last_line, _runs = Progress(), None, "", _runs + 1
    console.start()
    try:
        with process_state.kept(), dist_session(config.device, config.backend, timeout_s, group) as env:
            result = with_roll_call(body, Session(env, progress), timeout_s)
            if env.is_main:
                print(f"{label}: {result}", flush=True)
        return 0
    except InputError as e:
        last_failure = e
        return ending(EXIT_BAD_INPUT, str(e), everyone=not e.collective)
    except NonFiniteError as e:
        last_failure = e
        return ending(EXIT_NONFINITE, str(e))
    except Interrupted as e:
        if rank == 0:
            say(str(e))
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug or an environment failure: its traceback, then the one line
        last_failure = e
        if is_out_of_memory(e):  # bad input too (a model or batch too big): every rank that hit it says so
            return ending(EXIT_OUT_OF_MEMORY, out_of_memory_line(e, progress.phase_of(e), given or {}), everyone=True)
        if isinstance(e, LostRanks) and e.missing:  # a peer stopped answering: the lowest rank that answered says so
            return ending(EXIT_LOST_RANK, lost_rank_line(e, progress, timeout_s), everyone=True,
                          said=e.says_the_line(rank))
        if isinstance(e, LostRanks) and e.failed:  # a peer ended with an error of its own, and says its line
            return ending(EXIT_LOST_RANK, f"rank {e.failed[0]} ended with its own error", said=False)
        traceback.print_exc()
        return ending(EXIT_UNFORESEEN, first_line(e.__cause__ if isinstance(e, LostRanks) else e, 300),
                      everyone=True)
    finally:
        try:
            release_out_dirs()
            restore_signal_handlers()
        finally:
            console.end()


def with_roll_call(body: Callable[[Session], object], session: Session, timeout_s: float) -> object:
    """body(session), where a collective that fails because a peer did not take part becomes LostRanks, with the roll
    call taken while the group's store is there; a rank that fails by itself signs in as such, so that the others'
    roll call does not name it missing."""
    try:
        return body(session)
    except InputError:  # raised on every rank alike (validation is collective)
        raise
    except Exception as e:
        if is_collective_failure(e):
            raise lost_ranks(e, timeout_s) from e
        if dist.is_available() and dist.is_initialized():
            sign_in(FAILED)
        raise


@dataclass(frozen=True)
class Ending:
    """How this rank ends a run with a line: said (by rank 0, or by every rank, or by none where another says it), put
    into torchrun's summary, and kept for torchrun's next start where that start would end so again."""
    rank: int
    timeout: datetime.timedelta

    def __call__(self, code: int, message: str, everyone: bool = False, said: bool = True, again: str = "") -> int:
        global last_line
        last_line = f"{message}{again}"
        record_for_torchrun(f"error: {message}{again}")
        if code in ENDINGS_THAT_REPEAT:
            remember_ending(code, message, self.timeout)
        shared = everyone and code in SAID_ONCE  # each rank may have it, and if so alike: said by one
        says = first_to_say(f"error: {message}{again}", self.timeout) if shared else self.rank == 0 or everyone
        if said and says:
            say(f"error: {message}{again}")
        return code


def run_plain(body: Callable[[], object], label: str) -> int:
    """run() for a script without a process group (one process, no training loop): prints `<label>: <result>` on
    success, or one `error: ...` line and returns EXIT_BAD_INPUT on bad input."""
    try:
        result = body()
    except InputError as e:
        say(f"error: {e}")
        return EXIT_BAD_INPUT
    print(f"{label}: {result}", flush=True)
    return 0


def say(line: str) -> None:
    """One line on stderr in one write: ranks that share torchrun's stderr pipe then cannot interleave inside it (a
    pipe's writes of up to PIPE_BUF bytes are atomic), as print's text and newline could (seen: two ranks' lines run
    together). During a run, stderr is the console's (runtime/console.py), which writes each line whole."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def first_to_say(line: str, timeout: datetime.timedelta) -> bool:
    """Whether no other rank of this run has said `line` yet, counted in torchrun's agent store (the run: this torchrun
    start's, and its runs in this process so far, as every rank makes the same calls): a line every rank reaches alike
    (a bad row each of them read, a flag, an out of memory alike) is said once, one no other rank has by each rank
    that has it. True where there is no store to count in (outside torchrun) or it does not answer."""
    try:
        agent = agent_store(timeout)
        key = f"nanochat_ext/said/{restart_attempt()}/{_runs}/{hashlib.sha1(line.encode()).hexdigest()}"
        return agent is None or agent.add(key, 1) == 1
    except dist.DistError:
        return True


def record_for_torchrun(line: str) -> None:
    """Under torchrun, the line goes into the error file its agent gives each worker (TORCHELASTIC_ERROR_FILE), in the
    layout of torch's own @record (errors.ErrorHandler): its failure summary then shows the line where it would show
    `<N/A>`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the summary then says <N/A>; the line itself is printed all the same


def remember_ending(code: int, line: str, timeout: datetime.timedelta) -> None:
    """Under torchrun: this start ends with `code` and `line` for a reason a restart would meet again (bad input, a
    non-finite step, out of memory). torchrun restarts after any failure; the next start reads this
    (previous_ending) and ends at once instead of repeating the run up to the same line."""
    try:
        agent = agent_store(timeout)
        if agent is not None:
            agent.set(f"nanochat_ext/ended/{restart_attempt()}", json.dumps([code, line]))
    except dist.DistError:
        pass  # then the next start runs again: what it costs is time


def previous_ending(timeout: datetime.timedelta) -> tuple[int, str] | None:
    """What the previous start of this torchrun job ended with, if remember_ending recorded it."""
    key = f"nanochat_ext/ended/{restart_attempt() - 1}"
    try:
        agent = agent_store(timeout) if restart_attempt() > 0 else None
        if agent is None or not agent.check([key]):
            return None
        code, line = json.loads(agent.get(key))
    except dist.DistError:  # the store does not answer: start as if nothing was kept
        return None
    return code, line
