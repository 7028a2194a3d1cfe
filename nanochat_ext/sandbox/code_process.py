"""The code's own process inside the sandbox (sandbox/child.py starts it): the last walls, then the untrusted
code and the caller's probes, each probe's value a record on the results pipe. The standard library only: this
module is loaded before any untrusted line runs.

The last walls, in order: the rlimits (CPU, address space, file size, open files, processes, no core), a session
keyring of its own (an empty anonymous one: the caller's keys are not in reach), and the seccomp filter the caller
compiled (sandbox/seccomp.py: a BPF program, loaded here with a prctl).
"""
import builtins
import ctypes
import json
import os
import resource
import sys

MAX_VALUE = 64 << 10  # bytes of one record
MAX_DEPTH = 40  # of a value's nesting
THREADS_ONE = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}  # under RLIMIT_NPROC
KEYCTL_JOIN_SESSION_KEYRING = 1
WALLS_FAILED = 122  # the code's process's exit where its walls did not go up (the code never ran)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
_exit, _write, _dumps = os._exit, os.write, json.dumps  # the harness's own, whatever the code rebinds later


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def cpu_seconds(seconds: float) -> int:
    return max(int(seconds + 0.999), 1)


def load_filter(libc, bpf: bytes) -> None:
    """Load a BPF program (8 bytes an instruction) as this process's seccomp filter, no new privileges first."""
    program = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(program, ctypes.c_void_p))
    for args in ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)):
        if libc.prctl(*args) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def walls(job: dict, others: int, libc) -> None:
    """The limits, a keyring of its own and the seccomp filter (where the caller has one: where it has none, the
    start line said so), then "walls" on the walls pipe, closed before any code runs; where one does not go up, the
    reason there instead, and the code does not run."""
    seconds = cpu_seconds(job["seconds"])
    try:
        for limit, value in ((resource.RLIMIT_CPU, (seconds, seconds + 1)), (resource.RLIMIT_AS, job["memory_bytes"]),
                             (resource.RLIMIT_FSIZE, job["file_bytes"]), (resource.RLIMIT_NOFILE, job["open_files"]),
                             (resource.RLIMIT_NPROC, job["processes"] + others), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_MEMLOCK, 0), (resource.RLIMIT_RTPRIO, 0), (resource.RLIMIT_NICE, 0),
                             (resource.RLIMIT_MSGQUEUE, 0)):
            resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
        if job.get("keyctl") is not None:  # a new, empty session keyring: the caller's keys out of reach
            if libc.syscall(ctypes.c_long(job["keyctl"]), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
                raise OSError(ctypes.get_errno(), f"a keyring of its own: {os.strerror(ctypes.get_errno())}")
        if job.get("seccomp_bpf"):
            load_filter(libc, bytes.fromhex(job["seccomp_bpf"]))
    except (OSError, ValueError) as e:
        _write(job["walls_fd"], f"{e}\n"[:300].encode())
        _exit(WALLS_FAILED)
    _write(job["walls_fd"], b"walls\n")
    os.close(job["walls_fd"])


def run_code(job: dict, others: int, libc) -> None:
    """Behind the walls (others: processes of this user that RLIMIT_NPROC counts besides the code's), the code then
    every step in order; each probe's value (or error) a record. Never returns."""
    out = job["results_fd"]
    os.set_inheritable(out, False)  # an exec'd program starts without it
    walls(job, others, libc)
    os.environ.clear()
    os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=os.getcwd(), TMPDIR=os.getcwd(), LANG="C.UTF-8",
                      **THREADS_ONE)
    os.umask(0o077)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    steps = [("exec", job["code"], "the code")] + [tuple(s) for s in job["steps"]]
    for k, (kind, source, what) in enumerate(steps):
        record = step(kind, source, what, namespace)
        if record is not None:
            line = (_dumps({"step": k, **record}) + "\n").encode()
            if len(line) > MAX_VALUE:
                line = (_dumps({"step": k, "error": f"returned a value over {MAX_VALUE >> 10} KB"}) + "\n").encode()
            while line:
                line = line[_write(out, line):]
        if kind == "exec" and record is not None:  # the code, or the tests' own statements, failed: no more
            break
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    _exit(0)  # no exit hook of the code's runs


def step(kind: str, source: str, what: str, namespace: dict) -> dict | None:
    """One step: its record ({"value": ...} or {"error": ...}), or None for a statement that ran."""
    try:
        if kind == "exec":
            exec(compile(source, what, "exec"), namespace)
            return None
        value = eval(compile(source, what, "eval"), namespace)
        return {"value": encode(bool(value) if kind == "truth" else value)}
    except SystemExit as e:
        return {"error": f"exited (SystemExit: {shown(e.code)})"}
    except PlainError as e:
        return {"error": str(e)}
    except BaseException as e:  # the untrusted code's failure: what the caller shows the model
        return {"error": f"raised {described(e)}"}


class PlainError(ValueError):
    """A value with no plain form."""


def encode(value, depth: int = 0):
    """A value as tagged JSON of plain data (["int", "0x5"], ["list", [...]], ...): int, float, complex, str, bytes,
    bool, None, and lists, tuples, dicts and sets of them; a subclass (IntEnum, Counter, a namedtuple, a numpy
    scalar's .item()) as its plain base. PlainError for anything else. The caller decodes plain values and compares
    them itself, so nothing of the code's (an __eq__) takes part in a verdict."""
    if depth > MAX_DEPTH:
        raise PlainError("returned a value nested too deep")
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()
    for base in (bool, int, float, complex, str, bytes, type(None), list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            break
    else:
        raise PlainError(f"returned {type(value).__name__}, not a plain value (int, float, str, bytes, bool, None, "
                         f"or a list, tuple, dict or set of them)")
    name = base.__name__
    if base in (list, tuple, set, frozenset):
        return [name, [encode(v, depth + 1) for v in value]]
    if base is dict:
        return [name, [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if base is float:
        return [name, float.hex(value)]
    if base is complex:
        return [name, [float.hex(value.real), float.hex(value.imag)]]
    if base is bytes:
        return [name, bytes.hex(value)]
    if base is int:
        if int.bit_length(value) > 8 * MAX_VALUE:
            raise PlainError("returned an int too large to check")
        return [name, hex(int(value))]
    return [name, base(value) if base is not type(None) else None]  # str, bool, None


def shown(value) -> str:
    return repr(value)[:100] if type(value) in (str, bool, type(None)) or type(value) is int and -1e9 < value < 1e9 \
        else type(value).__name__


def described(e: BaseException) -> str:
    try:
        text = f"{e.msg} (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else str(e)
    except BaseException:
        text = ""
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__
