"""Untrusted Python code run sealed: in its own user, mount, pid, network, IPC and UTS namespaces where the OS allows
them (a root of its own: the system's programs, the Python installation and a few devices read-only, a private
/tmp, no network, no process outside it visible), under limits on wall clock, CPU, memory, file size, processes
and open files, behind a seccomp filter and, where the machine lets us make one, in a cgroup of its own (memory,
the kernel's for it included, and processes bounded together), every process it starts ended with it, stdin
closed, what it writes read up to a cap. sandbox/child.py and sandbox/code_process.py are the other side of
the wall; docs/tools.md says what it holds against and what it does not.

The caller asks for steps after the code: statements to run ("exec") and expressions whose value comes back
("value", or "truth": its truth value), as plain data (int, float, str, bytes, bool, None, and lists, tuples, dicts
and sets of them), never an object of the code's. What the code's process sends is untrusted: a caller that keeps
the expected answers to itself and compares here gets a verdict the code cannot forge.

    run = sandbox.run("def add(a, b):\n    return a + b", [("value", "add(2, 3)", "test 1")], Limits(seconds=5))
    run.values[1] == 5   # step k + 1: step 0 is the code itself

Where this machine refuses the namespaces (Docker's default seccomp profile, say), runs are unsealed and say so
(`isolation()`, for a run's start line); where it seals, a run that fails to seal does not run the code.
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanochat_ext.runtime.waits import not_counted
from nanochat_ext.sandbox import cgroups, seccomp
from nanochat_ext.sandbox.child import TIMED_OUT
from nanochat_ext.sandbox.code_process import MAX_DEPTH, MAX_VALUE, cpu_seconds

ROOT = str(Path(__file__).resolve().parents[2])  # the directory nanochat_ext lies in: the child imports from it
BOOT = f"import sys; sys.path.insert(0, {ROOT!r}); from nanochat_ext.sandbox.child import main; main()"
PYTHON = sys.executable  # the interpreter the code runs in (the trainer's)
KEPT_OUTPUT = 8 << 10  # bytes of the code's stdout and of its stderr kept; the rest is read and dropped
MAX_RECORDS = 1 << 20  # bytes of results read at most
MAX_ITEMS = 20_000  # plain values in one record, at most: decoding stays cheap whatever the code sends
START_SECONDS = 60.0  # the interpreter's start and the sealing, before the code's clock starts, at most (a loaded
# machine's): not the code's time; a sandbox not started by then failed to start
SWEEP_SECONDS = 1.0  # after the caller asks the supervisor to end (SIGUSR1), how long it may take to sweep
RUNS = threading.BoundedSemaphore(max(4, os.cpu_count() or 1))  # sandboxes of this process at once
EXTRA_PROCESSES = 3  # the supervisor, the namespaces' process and init, in the cgroup beside the code's


@dataclass(frozen=True)
class Limits:
    seconds: float = 5.0  # wall clock, and (rounded up) CPU seconds
    memory_mb: int = 512  # address space of each process
    file_mb: int = 1  # largest file; the code's directory holds 4x that
    processes: int = 8  # the code's process and its children (threads count)
    open_files: int = 64
    total_memory_mb: int = 1024  # every process of the sandbox and the kernel's memory for them, where a cgroup is


@dataclass
class Run:
    """What came back: each step's value or error (by step; step 0 is the code), the code's output (cut), how its
    process ended, whether it ran sealed, and behind which further walls."""
    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""
    status: int | None = None  # the code's exit code, 128 + the signal that ended it, or TIMED_OUT
    sealed: str = ""  # "sealed"; "off" or "unsealed (why)": it ran unsealed; "refused: why", "failed: why": not run
    garbled: str = ""  # why the results could not be read, where they could not
    seccomp: str = ""  # "seccomp", or why there was no filter
    cgroup: str = ""  # "cgroup v2", "cgroup v1", or why there was none
    unreported: bool = False  # the sandbox ended (or could not be started) before it said how it ran

    @property
    def ran(self) -> bool:
        return self.sealed in ("sealed", "off") or self.sealed.startswith("unsealed")

    @property
    def failed_to_start(self) -> bool:
        """The sandbox did not start, for a reason that may pass (the code had not run): no process or pipe to be had,
        a supervisor killed before it reported, walls that did not go up (a keyring quota). The machine's failure,
        not the row's. A failure it reports of itself (no uid map, unsealed as root) is the same every time: the
        trial at the run's start finds it (broken())."""
        return self.unreported or self.sealed.startswith("failed: the code's walls")

    def ended(self, limits: Limits) -> str:
        """How the code's process ended, in the words the model reads."""
        if self.status == TIMED_OUT:
            return f"timed out after {limits.seconds:g} s"
        if self.status is not None and 128 < self.status < 128 + signal.NSIG:
            name = signal_name(self.status - 128)
            return f"killed by {name}" + (f" (CPU time limit {cpu_seconds(limits.seconds)} s)" if name == "SIGXCPU"
                                          else "")
        return f"exit code {self.status}"


def signal_name(number: int) -> str:
    """SIGTERM for 15; "signal 40" for a number Python names no member of (the real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


_trial: list[Run] = []  # the first trial's run, where it said "sealed" or "refused: ..."
_trial_lock = threading.Lock()


def trial_run() -> Run:
    """How this machine runs a sandbox: its first trial's Run, sealed ("sealed"), never sealed ("refused: ..."), or
    failed ("failed: ...": asked again next time). A trial asks one value: a sandbox that says it ran but gives
    nothing back (its code's walls did not go up) failed. Where the namespaces are refused, the unsealed run is tried
    too: its failure (root, a Python nobody cannot read) is the trial's."""
    with _trial_lock:
        if _trial:
            return _trial[0]
        probe = [("value", "1", "the trial")]
        out = launch("pass", probe, Limits(seconds=5), isolate=True)
        if out.sealed.startswith("refused"):
            unsealed = launch("pass", probe, Limits(seconds=5), isolate=False)
            if not unsealed.ran:
                out.sealed = f"{unsealed.sealed} ({out.sealed})"
        if out.ran and out.values != {1: 1}:
            out.sealed = f"failed: the trial's code gave no value ({out.ended(Limits(seconds=5))}: " \
                         f"{out.stderr.strip()[-200:]})"
        if out.sealed == "sealed" or out.sealed.startswith("refused"):
            _trial.append(out)
        return out


def seal_trial() -> str:
    return trial_run().sealed


def run(code: str, steps: list[tuple[str, str, str]], limits: Limits = Limits()) -> Run:
    """Run the code, then each (kind, source, name) step: sealed where this machine seals (a run that fails to seal
    runs nothing), unsealed where it refuses the namespaces. A sandbox that fails to start (the machine's failure: the
    code had not run) is tried once more. The wait for a free slot (RUNS) and the sandbox's start are not counted
    against the caller's timeout (runtime/waits.py); from the code's start, it returns within limits.seconds + 3."""
    with not_counted():
        trial = seal_trial()
    for _ in range(2):
        with not_counted() as waiting, RUNS:
            try:
                out = launch(code, steps, limits, isolate=not trial.startswith("refused"), started=waiting.end)
            except OSError as e:  # the machine's: no process or pipe to be had
                out = Run(sealed=f"failed: {e}", unreported=True)
            if trial.startswith("refused") and out.sealed == "off":
                out.sealed = f"unsealed ({trial})"
        if not out.failed_to_start:
            break
    return out


def launch(code: str, steps: list[tuple[str, str, str]], limits: Limits, isolate: bool, started=None) -> Run:
    """One sandbox run; started() is called once the code's clock starts."""
    workdir, cgroup, bounded, fds = None, None, "", []
    try:
        workdir = None if isolate else tempfile.mkdtemp(prefix="sandbox-")
        cgroup, bounded = cgroups.make(limits.total_memory_mb << 20, limits.processes + EXTRA_PROCESSES)
        results_r, results_w = os.pipe()
        fds += [results_r, results_w]
        report_r, report_w = os.pipe()
        fds += [report_r, report_w]
        job = {"code": code, "steps": steps, "seconds": limits.seconds, "memory_bytes": limits.memory_mb << 20,
               "file_bytes": limits.file_mb << 20, "processes": limits.processes, "open_files": limits.open_files,
               "isolate": isolate, "results_fd": results_w, "report_fd": report_w, "workdir": workdir}
        bpf, job["keyctl"], job["seccomp_why"] = seccomp.program()
        job["seccomp_bpf"] = bpf.hex()
        try:
            proc = subprocess.Popen([PYTHON, "-I", "-c", BOOT], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(results_w, report_w),
                                    start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        finally:
            for fd in (results_w, report_w):
                fds.remove(fd)
                os.close(fd)
        with proc:
            if cgroup:  # while its interpreter starts (a v1 move waits out an RCU grace period), before it reads
                try:    # its job: nothing it runs is outside
                    cgroup.add(proc.pid)
                except OSError as e:
                    cgroup.remove()
                    cgroup, bounded = None, f"the sandbox could not join its cgroup ({e.strerror})"
            try:
                proc.stdin.write(json.dumps(job).encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
            streams = {proc.stdout.fileno(): ("stdout", KEPT_OUTPUT), proc.stderr.fileno(): ("stderr", KEPT_OUTPUT),
                       results_r: ("results", MAX_RECORDS), report_r: ("report", 4096)}
            records = sum(kind != "exec" for kind, _, _ in steps)
            read = read_capped(streams, limits.seconds, proc.pid, records, started)
            status = proc.wait()
    finally:
        for fd in fds:
            os.close(fd)
        if cgroup:
            cgroup.remove()  # every process of the sandbox, wherever it went
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report = read["report"].decode(errors="replace").splitlines() + ["", ""]
    out = Run(stdout=read["stdout"].decode(errors="replace"), stderr=read["stderr"].decode(errors="replace"),
              status=status if status >= 0 else 128 - status, sealed=report[0].strip(), seccomp=report[1].strip(),
              cgroup=bounded)
    if not out.sealed:  # the supervisor itself failed or was killed before it said
        out.sealed = f"failed: the sandbox ended ({out.ended(limits)}) {out.stderr.strip()[-200:]}".strip()
        out.unreported = True
    read_records(read["results"], out)
    return out


def read_capped(streams: dict[int, tuple[str, int]], seconds: float, supervisor: int, records: int,
                started=None) -> dict[str, bytes]:
    """Every stream read until it closes, each kept up to its cap, the rest dropped. The code's clock starts when
    the report's first line comes (started() is called then): the supervisor is asked to end (SIGUSR1: it kills
    everything below it) when the results hold as many lines as `records` (code that passed has nothing more to
    say: it would only burn the CPU others wait for), or past the code's seconds (its own clock ends it before);
    its process group is killed SWEEP_SECONDS later, or START_SECONDS after the start where it never reported;
    then what is left is drained."""
    kept = {name: bytearray() for name, _ in streams.values()}
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline, asked_at, killed_at, reported = time.monotonic() + START_SECONDS, None, None, False
    while sel.get_map():
        now = time.monotonic()
        if not reported and b"\n" in kept["report"]:  # the code's clock starts
            reported, deadline = True, now + seconds + 1.0
            if started is not None:
                started()
                started = None
        if asked_at is None and (now >= deadline or records and kept["results"].count(b"\n") >= records
                                 and b"\n" in kept["report"]):  # not before it said how it ran
            stop(supervisor)
            asked_at = now
        if killed_at is None and asked_at is not None and now >= asked_at + SWEEP_SECONDS:
            kill_group(supervisor)
            killed_at = now
        if killed_at is not None and now > killed_at + 1.0:
            break  # writers that outlive the kill (an unsealed run's escaped children): stop listening
        for key, _ in sel.select(timeout=0.05 if asked_at is not None else max(min(deadline - now, 0.25), 0.01)):
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
    if started is not None:
        started()
    return {name: bytes(data) for name, data in kept.items()}


def stop(supervisor: int) -> None:
    """Ask the supervisor to end: it kills every process below it (an escaped setsid child too), then exits."""
    try:
        os.kill(supervisor, signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_records(data: bytes, out: Run) -> None:
    """The results pipe's records into out.values and out.errors: the first record of each step counts; a line
    that is not a record, too long a line, a step written twice or the pipe's cap reached marks the run garbled."""
    if len(data) >= MAX_RECORDS:
        out.garbled = f"wrote over {MAX_RECORDS >> 20} MB of results"
    for line in data.splitlines():
        try:
            if len(line) > MAX_VALUE + 1024:
                raise ValueError("a record over the size of a value")
            rec = json.loads(line)
            step = rec["step"]
            if not isinstance(step, int) or step in out.values or step in out.errors:
                raise ValueError(f"step {step!r} written twice")
            if "error" in rec:
                out.errors[step] = str(rec["error"])[:300]
            else:
                out.values[step] = decode(rec["value"], [MAX_ITEMS])
        except (ValueError, KeyError, TypeError, RecursionError, MemoryError, OverflowError) as e:
            out.garbled = out.garbled or f"the results channel was written to ({type(e).__name__})"


def decode(tagged: Any, budget: list[int], depth: int = 0) -> Any:
    """child.encode's tagged JSON back to plain values, at most budget[0] of them (a record of colliding
    hashes cannot make a set slow to build); ValueError for anything else."""
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH or not (isinstance(tagged, list) and len(tagged) == 2
                                                   and isinstance(tagged[0], str)):
        raise ValueError("not a tagged value, or too many")
    kind, v = tagged
    if kind in ("list", "tuple", "set", "frozenset"):
        items = [decode(x, budget, depth + 1) for x in v]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
    if kind == "dict":
        return {decode(k, budget, depth + 1): decode(x, budget, depth + 1) for k, x in v}
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


def broken() -> str | None:
    """Why the model's code cannot run on this machine (the trial failed), or None: a run that needs the sandbox says
    so in one line at its start, rather than scoring every row 0."""
    trial = trial_run()
    return None if trial.sealed == "sealed" or trial.sealed.startswith("refused") else trial.sealed


def isolation() -> str:
    """What a sandboxed run gets on this machine, for a run's start lines: the namespaces, the seccomp filter and the
    cgroup, each said where it is missing."""
    trial = trial_run()
    bounded = (f"memory and processes bounded together by a {trial.cgroup}" if trial.cgroup.startswith("cgroup v")
               else f"memory bounded per process only: {trial.cgroup}")
    walls = f"{'a seccomp filter' if trial.seccomp == 'seccomp' else trial.seccomp or 'no seccomp filter'}, {bounded}"
    if trial.sealed == "sealed":
        return ("sealed: own user, mount, pid and network namespaces (a read-only root of the system's programs and "
                "Python, its own /tmp, no network, no process outside visible), every process ended with it, limits "
                f"on time, CPU, memory, files and processes, {walls}")
    if trial.sealed.startswith("refused"):
        return (f"NOT sealed from the filesystem and network ({trial.sealed}): limits on time, CPU, memory, files and "
                f"processes, {walls}, every process ended with it; run untrusted code in a container")
    return f"broken ({trial.sealed}): the code cannot run"
