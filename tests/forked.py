"""The client of tests/workers/fork_server.py: `python ARGS` (or launch.py's N ranks of it) run as a fork of one warm
interpreter per pytest worker, answered as subprocess.run(capture_output=True, text=True) answers. Commands whose
environment differs from the server's where libraries read it at import (READ_AT_IMPORT) run as fresh interpreters,
and so does everything under NANOCHAT_TEST_FORK=0 or on a machine with a GPU."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "workers" / "fork_server.py"
# Environment variables that torch, its libraries, inductor or transformers read at import: a command that sets any
# of them otherwise than the server was started with runs as a fresh interpreter.
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_", "ONEDNN_", "DNNL_", "TORCH", "PYTORCH_", "CUDA_", "HF_",
                  "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "HOME", "XDG_", "TMPDIR")


class ForkServer:
    """One server, started on first use with this process's environment (OMP_NUM_THREADS=1, the repo on the path);
    it ends with this process (its PDEATHSIG) or at exit."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="fork_server_")
        self.socket = os.path.join(self.dir, "socket")
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, str(SERVER), self.socket], env=self.env, cwd=REPO,
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{SERVER} did not start (exit {self.proc.wait()})")
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def serves(self, env: dict) -> bool:
        keys = {k for k in {*env, *self.env} if k.startswith(READ_AT_IMPORT)} - {"PYTHONPATH"}
        return self.proc.poll() is None and all(env.get(k) == self.env.get(k) for k in keys)

    def run(self, command: list[str], nproc: int, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        out, err = (os.path.join(self.dir, name) for name in ("stdout", "stderr"))
        request = {"command": command, "nproc": nproc, "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(self.socket)
            conn.sendall((json.dumps(request) + "\n").encode())
            answer = Lines(conn)
            pid = int(answer.next(None))
            try:
                code = int(answer.next(time.monotonic() + timeout))
            except BaseException as e:  # the timeout, or the test's own (an alarm, ^C): the fork ends first
                with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                    os.kill(pid, signal.SIGKILL)  # as subprocess.run kills its child
                answer.next(None)  # the server has reaped it and is free for the next command
                if isinstance(e, PastDeadline):
                    raise subprocess.TimeoutExpired(command, timeout, read(out), read(err)) from None
                raise
        return subprocess.CompletedProcess([sys.executable, *command], code, read(out), read(err))


class PastDeadline(Exception):
    """The command's timeout (not a TimeoutError, which a test's own alarm raises: that one is re-raised as it is)."""


class Lines:
    """The server's answer, a line at a time, each awaited until a deadline (time.monotonic(); None: no limit)."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer = conn, b""

    def next(self, deadline: float | None) -> str:
        while b"\n" not in self.buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self.conn], [], [], left)[0]):
                raise PastDeadline
            chunk = self.conn.recv(4096)
            if not chunk:
                raise ConnectionError("the fork server closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


_server: ForkServer | None | bool = None  # False: it failed to start, and commands run fresh


def run_python(command: list[str], nproc: int, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python COMMAND` (nproc 1) or `python tests/workers/launch.py NPROC COMMAND`, in cwd with exactly env."""
    global _server
    # On a GPU machine every command runs fresh: a library that touches CUDA at import leaves a driver state that a
    # forked child cannot use.
    if os.environ.get("NANOCHAT_TEST_FORK", "1") != "0" and _server is not False and not torch.cuda.is_available():
        if _server is None:
            try:
                _server = ForkServer()
            except RuntimeError as e:  # an import it makes is broken: the commands themselves will say how
                print(f"forked.py: {e}; commands run as fresh interpreters", file=sys.stderr)
                _server = False
        if _server and _server.serves(env):
            return _server.run(command, nproc, env, cwd, timeout)
    launch = [] if nproc == 1 else [str(REPO / "tests" / "workers" / "launch.py"), str(nproc)]
    return subprocess.run([sys.executable, *launch, *command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
