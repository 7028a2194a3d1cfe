"""The code's own process inside the sandbox (runtime/sandbox_child.py starts it): the last walls, then the untrusted
code and the caller's probes, each probe's value a record on the results pipe. The standard library and pyseccomp
only: this module is loaded before any untrusted line runs.

The last walls, in order: the rlimits (CPU, address space, file size, open files, processes, no core), a session
keyring of its own (an empty anonymous one: the caller's keys are not in reach), and a seccomp filter (libseccomp,
through pyseccomp) that refuses, with EPERM, the system calls the code has no use for and the kernel's riskiest
surface: the keyring's calls, ptrace and process_vm_*, bpf, perf_event_open, userfaultfd, io_uring, the mount family,
namespaces (unshare, setns), modules, kexec, reboot, swap, and every socket family but AF_UNIX (AF_VSOCK, AF_NETLINK
and AF_INET included: no network behind the network namespace either). Calls of another ABI (32-bit int 0x80 on
x86_64) kill the process (libseccomp's default for a foreign architecture).
"""
import builtins
import ctypes
import ctypes.util
import errno
import json
import os
import resource
import socket
import sys



def import_pyseccomp():
    """pyseccomp, or why not. It looks its libraries up with ctypes.util.find_library, which runs `ldconfig -p`
    (about 20 ms, in every sandbox's start): their sonames first, the lookup only where those do not load."""
    sonames = {"seccomp": "libseccomp.so.2", "c": "libc.so.6"}
    real = ctypes.util.find_library
    for find in (lambda name: sonames.get(name) or real(name), real):
        ctypes.util.find_library = find
        try:
            import pyseccomp
            return pyseccomp, ""
        except Exception as e:  # not installed, or no libseccomp.so.2 on this machine
            sys.modules.pop("pyseccomp", None)
            why = f"{type(e).__name__}: {e}"
        finally:
            ctypes.util.find_library = real
    return None, why


pyseccomp, NO_SECCOMP = import_pyseccomp()

MAX_VALUE = 64 << 10  # bytes of one record
MAX_DEPTH = 40  # of a value's nesting
THREADS_ONE = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}  # under RLIMIT_NPROC
DENIED = ("keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "bpf",
          "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "mount", "umount2",
          "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
          "mount_setattr", "unshare", "setns", "init_module", "finit_module", "delete_module", "kexec_load",
          "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "name_to_handle_at",
          "open_by_handle_at", "fanotify_init", "lookup_dcookie", "iopl", "ioperm", "personality", "vhangup")
NEW_NAMESPACE = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
KEYCTL_JOIN_SESSION_KEYRING = 1
_exit, _write, _dumps = os._exit, os.write, json.dumps  # the harness's own, whatever the code rebinds later


def cpu_seconds(seconds: float) -> int:
    return max(int(seconds + 0.999), 1)


def seccomp_filter():
    """The filter (not yet loaded), or a str saying why there is none."""
    if pyseccomp is None:
        return f"no seccomp filter (pyseccomp: {NO_SECCOMP})"
    try:
        f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        for name in DENIED:
            try:
                f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
            except (ValueError, OSError):  # a call this architecture does not have (iopl on arm64)
                pass
        for call in ("socket", "socketpair"):
            f.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), call, pyseccomp.Arg(0, pyseccomp.NE, socket.AF_UNIX))
        for flag in NEW_NAMESPACE:  # clone's flags are its first argument on every architecture we know
            f.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags hide behind a pointer: libc falls back to clone
        return f
    except Exception as e:  # libseccomp refused to build it
        return f"no seccomp filter ({type(e).__name__}: {e})"


def filter_state() -> str:
    """"seccomp" where the filter builds on this machine, else why not (the run's start line says so)."""
    f = seccomp_filter()
    return f if isinstance(f, str) else "seccomp"


def own_keyring(libc) -> None:
    """A new, empty anonymous session keyring: the caller's session keys out of reach (seccomp then refuses the
    keyring's calls altogether)."""
    if pyseccomp is None:
        return
    try:
        number = pyseccomp.resolve_syscall(pyseccomp.system_arch(), "keyctl")
    except Exception:  # no such call here
        return
    libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None)


def walls(job: dict, others: int, libc) -> None:
    """The limits, a keyring of its own and the seccomp filter (where it builds: where it does not, the start line
    said so). A filter that builds but does not load: the code does not run."""
    seconds = cpu_seconds(job["seconds"])
    for limit, value in ((resource.RLIMIT_CPU, (seconds, seconds + 1)), (resource.RLIMIT_AS, job["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, job["file_bytes"]), (resource.RLIMIT_NOFILE, job["open_files"]),
                         (resource.RLIMIT_NPROC, job["processes"] + others), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
    own_keyring(libc)
    f = seccomp_filter()
    if not isinstance(f, str):
        try:
            f.load()
        except Exception as e:
            os.write(2, f"sandbox: the seccomp filter did not load ({e})\n".encode())
            _exit(125)


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
