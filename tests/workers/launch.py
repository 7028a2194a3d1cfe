"""N ranks of one command, launched as torchrun launches its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store) but without torchrun's agent: the tests that only need
ranks use it, since the agent process costs ~2 s of CPU a launch (it imports torch) and the suite launches dozens.
Tests of what the agent does (restarts, its error files and summary) launch torchrun itself.

    python tests/workers/launch.py N -m scripts.kat_train_rm -- ARGS...
    python tests/workers/launch.py N tests/workers/grad_workers.py ARGS...

The command's imports (torch, the package, the script's module) are made once, here, and each rank is a fork of this
process that then runs the command as `python` would run it: importing torch is ~1.7 s of CPU a process, which each
rank would otherwise pay again. The ranks are still separate processes in their own process group with their own
gloo connections; nothing has run in this process before the forks but imports (no thread pool started, no
collective). Unlike fresh interpreters, the ranks share one string-hash seed (a set of strings iterates alike on
every rank): the tests that must catch collectives issued in a rank-dependent order run under torchrun
(NANOCHAT_TEST_TORCHRUN=1 puts every launch there). As torchrun does, the first rank
that fails ends the others, and its exit code is the launch's (torchrun's own is 1 with a summary: the tests that
read it use torchrun).
"""
import importlib
import os
import random
import runpy
import socket
import sys
import time
import traceback

from nanochat_ext.sandbox.child import die_with_parent


def preimport(command: list[str]) -> None:
    """Import what the ranks will: torch and, for `-m module`, the module's own imports (the module itself is then run
    afresh as __main__ in each rank). A failing import is left for the ranks to report, as `python` would."""
    try:
        import torch  # noqa: F401
        if command[0] == "-m":
            importlib.import_module(command[1])
            sys.modules.pop(command[1])  # run as __main__ in each rank, not this copy
    except BaseException:
        pass


def run_rank(rank: int, n: int, port: int, command: list[str]) -> None:
    """In the forked rank: torchrun's environment, then the command as `python -m module args` or `python path args`
    runs it; the script's own sys.exit is the rank's exit code, an exception's traceback is printed and exits 1."""
    die_with_parent()  # a launcher killed (a test's timeout) takes its ranks with it, as torchrun's agent does
    random.seed()  # the parent's state is every rank's after fork: draw afresh, as a new interpreter would
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    run_as_python(command)
    sys.exit(0)


def run_as_python(command: list[str]) -> None:
    """The command as `python -m module args`, `python -c code args` or `python path args` runs it: its sys.argv
    and sys.path[0]."""
    if command[0] == "-c":
        sys.argv = ["-c", *command[2:]]
        sys.path[0] = ""  # as `python -c` puts it: the working directory
        exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        sys.path[0] = os.path.dirname(os.path.abspath(command[0]))
        runpy.run_path(command[0], run_name="__main__")


def main(n: int, command: list[str]) -> int:
    preimport(command)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                run_rank(rank, n, port, command)
            except SystemExit:
                raise
            except BaseException:
                traceback.print_exc()
                raise SystemExit(1) from None  # flushes and runs atexit, as python does after an uncaught exception
        ranks.append(pid)
    codes: dict[int, int] = {}
    failed = []
    while len(codes) < n and not failed:
        pid, status = os.wait()
        if pid in ranks:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0:
                failed.append(codes[pid])
    for pid in ranks:
        if pid not in codes:
            os.kill(pid, 15)
    deadline = time.monotonic() + 30
    for pid in ranks:
        if pid in codes:
            continue
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
