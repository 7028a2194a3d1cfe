"""A warm interpreter that runs the tests' commands as forks of itself (conftest.run_script, run_worker): it imports
torch and the libraries the scripts import once, then each command is a fork that runs it as `python` would (one
process, or launch.py's ranks forked from it), in the command's own working directory, environment and output files.
A fresh interpreter spends ~2 s of CPU importing torch and transformers before the script's first line; the suite
starts ~100 of them, on 2 cores.

    python tests/workers/fork_server.py SOCKET     # conftest starts one per pytest worker, and ends it with the worker

One request a connection, a JSON line: {"command": [...python's arguments: "-m", module, args / path, args],
"nproc": N (1: the command itself; more: launch.py's ranks), "cwd", "env", "stdout", "stderr" (files to write)}.
The answer: the fork's pid, a line, then its exit code (a negative code: killed by that signal), a line.

Only imports run here before a fork (no thread started, no generator drawn, nothing compiled), so a fork starts
where a fresh interpreter's imports leave it, but for four things: modules a fresh one would not have loaded yet
(dynamo's counters then read 0 where compiled.py would skip them), the environment that libraries read at import
(thread counts, CPU capability, inductor's and Hugging Face's settings: the client forks only commands whose
variables of those kinds are this server's), the string-hash seed (shared, as launch.py's ranks share it) and stdin
(/dev/null). A command that patches a function before the trainers import it (tests/workers/die_at.py) finds them
imported already, with the function bound: such a command runs as a fresh interpreter (subprocess, not run_python).
"""
import atexit
import importlib
import json
import os
import random
import socket
import sys
import threading

import launch
import numpy
import peft  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedModel  # noqa: F401

# What the commands import, which every fork then has for free: torch and the trainers (~1.2 s of CPU a process),
# transformers' models, peft and dynamo (~2.4 s more where a run loads a Hugging Face model), inductor (~0.9 s where
# it compiles).
TRAINERS = ("kat_train_rm", "kat_train_grpo", "kat_train_dpo", "kat_sft", "kat_eval", "kat_compute_density")
for name in TRAINERS:
    importlib.import_module(f"scripts.{name}")
    sys.modules.pop(f"scripts.{name}")  # each fork runs it afresh as __main__


def run_request(request: dict) -> None:
    """In the fork: the command's directory, environment, output and sys.path as `python` would set them, then the
    command; never returns (exits as python exits: atexit functions, flushed output, the command's code)."""
    code = 1
    try:
        launch.die_with_parent()  # the server ended (its pytest worker gone, or a test's timeout): so is the command
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        random.seed()  # the server's states are every fork's: draw afresh, as a new interpreter would
        numpy.random.seed()
        if request["nproc"] == 1:
            launch.run_as_python(request["command"])
            code = 0
        else:
            code = launch.main(request["nproc"], request["command"])
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as python reports an uncaught exception
    try:
        threading._shutdown()  # as python ends: its threads that are not daemons run to their end first
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def exit_code(code) -> int:
    """What python exits with for sys.exit(code): None 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def serve(path: str) -> None:
    launch.die_with_parent()  # its pytest worker gone, the server goes too
    assert threading.active_count() == 1, "an import started a thread: a fork would hold a copy of its locks"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rw") as stream:
            request = json.loads(stream.readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                run_request(request)
            stream.write(f"{pid}\n")
            stream.flush()
            _, status = os.waitpid(pid, 0)
            try:
                stream.write(f"{os.waitstatus_to_exitcode(status)}\n")
                stream.flush()
            except OSError:
                pass  # the client stopped waiting (its timeout): nothing to tell


if __name__ == "__main__":
    serve(sys.argv[1])
