"""Untrusted Python code run sealed: in its own user, mount, pid, network, IPC and UTS namespaces where the OS allows
them (the filesystem read-only but its own directory, no network, no process outside it visible), under limits on
wall clock, CPU, memory, file size, processes and open files, every process it starts ended with it, stdin closed,
and what it writes read up to a cap. runtime/sandbox_child.py is the other side of the wall.

The caller asks for steps after the code: statements to run ("exec") and expressions whose value comes back
("value", or "truth": its truth value), as plain data (int, float, str, bytes, bool, None, and lists, tuples, dicts
and sets of them), never an object of the code's. What the code's process sends is untrusted: a caller that keeps
the expected answers to itself and compares here gets a verdict the code cannot forge.

    run = sandbox.run("def add(a, b):\n    return a + b", [("value", "add(2, 3)", "test 1")], Limits(seconds=5))
    run.values[1] == 5   # step k + 1: step 0 is the code itself
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("sandbox_child.py")
KEPT_OUTPUT = 8 << 10  # bytes of the code's stdout and of its stderr kept; the rest is read and dropped
MAX_RECORDS = 1 << 20  # bytes of results read at most
SETUP_SECONDS = 2.0  # beyond the limit: the interpreter's start and the sealing, before the code's clock starts
TIMED_OUT = 124  # sandbox_child's exit code when the wall clock ended the run
MAX_DEPTH = 50


@dataclass(frozen=True)
class Limits:
    seconds: float = 5.0  # wall clock, and (rounded up) CPU seconds
    memory_mb: int = 512  # address space of each process
    file_mb: int = 1  # largest file; the code's directory holds 4x that
    processes: int = 16
    open_files: int = 64


@dataclass
class Run:
    """What came back: each step's value or error (by step; step 0 is the code), the code's output (cut), how its
    process ended, and whether it ran sealed."""
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""
    status: int | None = None  # the code's exit code, 128 + the signal that ended it, or TIMED_OUT
    sealed: str = ""  # "sealed", "off" or "refused: why" (it ran unsealed), or "failed: why" (it did not run)
    garbled: str = ""  # why the results could not be read, where they could not

    def ended(self, limits: Limits) -> str:
        """How the code's process ended, in the words the model reads."""
        if self.status == TIMED_OUT:
            return f"timed out after {limits.seconds:g} s"
        if self.status is not None and self.status > 128:
            try:
                name = signal.Signals(self.status - 128).name
            except ValueError:
                name = f"signal {self.status - 128}"
            cpu = f" (CPU time limit {cpu_seconds(limits)} s)" if name in ("SIGXCPU", "SIGKILL") else ""
            return f"killed by {name}{cpu}"
        return f"exit code {self.status}"


def cpu_seconds(limits: Limits) -> int:
    return max(int(limits.seconds + 0.999), 1)


def run(code: str, steps: list[tuple[str, str, str]], limits: Limits = Limits(), isolate: bool = True) -> Run:
    """Run the code, then each (kind, source, name) step, sealed where this machine seals (the first run in a process
    tries; where it could not seal, every run is unsealed, as the run's start line says; where it could, a run that
    fails to seal does not run the code); returns within limits.seconds + SETUP_SECONDS."""
    if isolate and (trial := seal_trial()) != "sealed":
        out = launch(code, steps, limits, isolate=False)
        out.sealed = trial
        return out
    return launch(code, steps, limits, isolate)


@functools.lru_cache(maxsize=None)
def seal_trial() -> str:
    """Whether this machine seals a run: "sealed", or why not ("refused: ..." or "failed: ..."), asked once."""
    return launch("pass", [], Limits(seconds=5), isolate=True).sealed


def launch(code: str, steps: list[tuple[str, str, str]], limits: Limits, isolate: bool) -> Run:
    results_r, results_w = os.pipe()
    report_r, report_w = os.pipe()
    job = {"code": code, "steps": steps, "seconds": limits.seconds, "memory_bytes": limits.memory_mb << 20,
           "file_bytes": limits.file_mb << 20, "processes": limits.processes, "open_files": limits.open_files,
           "isolate": isolate, "results_fd": results_w, "report_fd": report_w}
    try:
        proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(results_w, report_w), start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    finally:
        os.close(results_w)
        os.close(report_w)
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    streams = {proc.stdout.fileno(): ("stdout", KEPT_OUTPUT), proc.stderr.fileno(): ("stderr", KEPT_OUTPUT),
               results_r: ("results", MAX_RECORDS), report_r: ("report", 4096)}
    read = read_capped(streams, time.monotonic() + limits.seconds + SETUP_SECONDS, proc.pid)
    for fd in (results_r, report_r):
        os.close(fd)
    proc.stdout.close()
    proc.stderr.close()
    status = proc.wait()
    out = Run(stdout=read["stdout"].decode(errors="replace"), stderr=read["stderr"].decode(errors="replace"),
              status=status if status >= 0 else 128 - status, sealed=read["report"].decode().strip())
    if not out.sealed:  # the supervisor itself failed or was killed before it said
        out.sealed = f"failed: the sandbox ended ({out.ended(limits)}) {out.stderr.strip()[-200:]}".strip()
    read_records(read["results"], out)
    return out


def read_capped(streams: dict[int, tuple[str, int]], deadline: float, group: int) -> dict[str, bytes]:
    """Every stream read until it closes, each kept up to its cap, the rest dropped; at the deadline the process
    group is killed (a sandbox's supervisor and, with it, everything it started) and what is left is drained."""
    kept = {name: bytearray() for name, _ in streams.values()}
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    killed_at = None
    while sel.get_map():
        now = time.monotonic()
        if killed_at is None and now >= deadline:
            kill_group(group)
            killed_at = now
        if killed_at is not None and now > killed_at + 1.0:
            break  # writers that outlive the kill (an unsealed run's escaped children): stop listening
        for key, _ in sel.select(timeout=max(min(deadline - now, 0.25), 0.01)):
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fd)
                continue
            name, cap = streams[key.fd]
            kept[name] += chunk[:max(cap - len(kept[name]), 0)]
    sel.close()
    return {name: bytes(data) for name, data in kept.items()}


def kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_records(data: bytes, out: Run) -> None:
    """The results pipe's records into out.values and out.errors: the first record of each step counts; a line
    that is not a record, a step written twice or the pipe's cap reached marks the run garbled."""
    if len(data) >= MAX_RECORDS:
        out.garbled = f"wrote over {MAX_RECORDS >> 20} MB of results"
    for line in data.splitlines():
        try:
            rec = json.loads(line)
            step = rec["step"]
            if not isinstance(step, int) or step in out.values or step in out.errors:
                raise ValueError(f"step {step!r} written twice")
            if "error" in rec:
                out.errors[step] = str(rec["error"])[:300]
            else:
                out.values[step] = decode(rec["value"])
        except (ValueError, KeyError, TypeError, RecursionError, MemoryError, OverflowError) as e:
            out.garbled = out.garbled or f"the results channel was written to ({type(e).__name__})"


def decode(tagged: Any, depth: int = 0) -> Any:
    """sandbox_child.encode's tagged JSON back to plain values; ValueError for anything else."""
    if depth > MAX_DEPTH or not (isinstance(tagged, list) and len(tagged) == 2 and isinstance(tagged[0], str)):
        raise ValueError("not a tagged value")
    kind, v = tagged
    if kind in ("list", "tuple", "set", "frozenset"):
        items = [decode(x, depth + 1) for x in v]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
    if kind == "dict":
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
    if kind == "int" and isinstance(v, str):
        return int(v, 16)
    if kind == "float" and isinstance(v, str):
        return float.fromhex(v)
    if kind == "complex" and isinstance(v, list) and len(v) == 2:
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if kind == "bytes" and isinstance(v, str):
        return bytes.fromhex(v)
    if (kind, type(v)) in (("str", str), ("bool", bool), ("NoneType", type(None))):
        return v
    raise ValueError(f"not a tagged value: {kind}")


def isolation() -> str:
    """What a sandboxed run gets on this machine, for a run's start lines."""
    trial = seal_trial()
    if trial == "sealed":
        return ("sealed: own user, mount, pid and network namespaces (the filesystem read-only but its own "
                "directory, no network, no process outside visible), every process ended with it, limits on time, "
                "CPU, memory, files and processes")
    return (f"NOT sealed from the filesystem and network ({trial}): limits on time, CPU, memory, files and "
            f"processes only, every process ended with it; run untrusted code in a container")
