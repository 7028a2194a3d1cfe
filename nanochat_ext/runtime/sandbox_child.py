"""The sandbox's side of the wall: runtime/sandbox.py starts this file as `python -I sandbox_child.py`. It seals
itself off, runs the untrusted code, then the steps the caller asked for, and writes what each probe gave on a pipe.
The standard library only; the job is read from stdin before any untrusted line runs. The processes, outermost first:

    supervisor  the caller's child: the wall clock; at the end it kills every process below it (their subreaper);
                it maps the namespaces' uid from outside (nobody where the caller is root: RLIMIT_NPROC binds)
    namespaces  unshares user, mount, pid, network, IPC and UTS namespaces, and chroots into a new root: a read-only
                tmpfs holding only SYSTEM (/usr, /bin, /lib*, /etc) and the Python installation bound read-only,
                DEVICES, and a tmpfs of the code's own at /tmp; no SysV IPC, no nested user namespaces
    init        pid 1 of the new pid namespace: it ends when the code's process does, and the kernel kills the rest
    code        every capability dropped, no new privileges, the limits set, stdin /dev/null: the untrusted code

Unsealed (the caller asks for it where the OS refuses namespaces), the code runs in the caller's temporary directory
under the limits, as nobody where the caller is root (not at all where nobody cannot read the Python installation).
The results pipe carries a JSON line a record, {"step": k, "value": ...} or {"step": k, "error": "..."}: what the
code's process says, which the caller does not trust. The report pipe, which the code never holds, says how it ran:
"sealed" or "off" (unsealed), else why the code did not run ("refused: ..." where unshare was, "failed: ...").
"""
import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
NAMESPACES = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000  # NS UTS IPC USER PID NET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_PRIVATE = 1024, 2048, 1 << 21, 1 << 18
KEPT_FLAGS = {os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
              os.ST_RELATIME: MS_RELATIME}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
NOBODY = 65534
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")  # what the new root shows
DEVICES = ("null", "zero", "full", "random", "urandom")
# No SysV shared memory or message queues (outside RLIMIT_AS, outliving processes), no nested user namespaces.
NO_MORE = {"/proc/sys/kernel/shmmni": "0", "/proc/sys/kernel/shmall": "0", "/proc/sys/kernel/msgmni": "0",
           "/proc/sys/user/max_user_namespaces": "0"}
WORK = "/tmp"  # the code's directory, its $HOME and $TMPDIR, inside the new root
TIMED_OUT = 124  # the supervisor's exit code when the wall clock ended the run
MAX_VALUE = 64 << 10  # bytes of one record
MAX_DEPTH = 40  # of a value's nesting
THREADS_ONE = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}  # under RLIMIT_NPROC
_exit, _write, _dumps = os._exit, os.write, json.dumps  # the harness's own, whatever the code rebinds later


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def die_with_parent() -> None:
    """SIGKILL when the parent dies (it may already have: then now)."""
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        _exit(1)


def cpu_seconds(seconds: float) -> int:
    return max(int(seconds + 0.999), 1)


# ---- the supervisor ----

def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    job["show"] = python_paths()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    die_with_parent()  # the caller gone: so are we, and all below
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the code stay ours to end
    report = job["report_fd"]
    os.set_inheritable(report, False)
    said, child = sealed_child(job) if job["isolate"] else unsealed_child(job)  # sealed asked: sealed or nothing
    _write(report, f"{said}\n".encode())
    os.close(report)
    os.close(job["results_fd"])
    if child is None:  # the code does not run
        _exit(0)
    signal.signal(signal.SIGALRM, lambda *_: end(TIMED_OUT))
    signal.setitimer(signal.ITIMER_REAL, job["seconds"])
    _, status = os.waitpid(child, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    end(exit_code(status))


def python_paths() -> list[str]:
    """Where this interpreter's standard library and packages lie (this file's own directory left out)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path[1:]}
    return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})


def sealed_child(job: dict) -> tuple[str, int | None]:
    """("sealed", the namespaces' first process), its uid mapped from here (only a process outside may map another
    uid than its own); else ("refused: why", None) where unshare is refused, ("failed: why", None) where sealing
    failed after it (then the code does not run)."""
    to_parent, to_child = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:
        for fd in (job["report_fd"], to_parent[0], to_child[1]):
            os.close(fd)
        namespaces(job, to_parent[1], to_child[0])  # never returns
    os.close(to_parent[1])  # the child's ends: its death is an end of file here
    os.close(to_child[0])
    said = read_line(to_parent[0])
    if said == "unshared":
        uid, gid = (NOBODY, NOBODY) if os.getuid() == 0 else (os.getuid(), os.getgid())
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/{child}/{name}", "w") as f:
                    f.write(text)
            _write(to_child[1], b"mapped\n")
            said = read_line(to_parent[0])
        except OSError as e:
            said = f"failed: the uid map: {e.strerror}"
    os.close(to_parent[0])
    os.close(to_child[1])
    if said == "sealed":
        return said, child
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return said or "failed: the namespaces' process ended", None


def unsealed_child(job: dict) -> tuple[str, int | None]:
    """The code in the caller's directory under the limits: as nobody where we are root, and not at all where
    nobody could not read the Python installation (it would have to run as root)."""
    nobody = os.getuid() == 0
    if nobody and not readable_by_others(job["show"]):
        return "failed: unsealed, the code would run as root (nobody cannot read the Python installation)", None
    try:
        if nobody:
            os.chown(job["workdir"], NOBODY, NOBODY)
    except OSError as e:  # a user namespace with no nobody in it
        return f"failed: unsealed, nobody cannot have the code's directory ({e.strerror})", None
    child = os.fork()
    if child == 0:
        os.close(job["report_fd"])
        os.chdir(job["workdir"])
        if nobody:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
        die_with_parent()  # after the change of credentials, which clears it
        run_code(job, others=processes_of(os.getuid()) - 1)  # the user's other tasks (other sandboxes' too)
    return "off", child


def end(code: int) -> None:
    """Kill every process below us (a pid namespace goes with its init), reap them, and exit with the code's status:
    its exit code, 128 + the signal that ended it, or TIMED_OUT."""
    for _ in range(1000):
        alive = descendants(os.getpid())
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()
        time.sleep(0.001)
    reap()
    _exit(min(code, 255))


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def descendants(pid: int) -> list[int]:
    """Every living descendant of pid, from the children lists of /proc."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def processes_of(uid: int) -> int:
    """How many tasks (threads too) the user runs: what RLIMIT_NPROC counts, unsealed."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            n += int(status["Threads"]) if int(status["Uid"].split()[0]) == uid else 0
        except (OSError, KeyError, ValueError):
            continue
    return n


def read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def readable_by_others(paths: list[str]) -> bool:
    def readable(p: str) -> bool:
        parts = p.split("/")
        ancestors = ["/".join(parts[:k]) or "/" for k in range(1, len(parts))]
        return all(os.stat(d).st_mode & 0o001 for d in ancestors) and os.stat(p).st_mode & 0o005 == 0o005
    return all(readable(p) for p in paths)


# ---- inside the namespaces ----

def namespaces(job: dict, to_parent: int, from_parent: int) -> None:
    die_with_parent()
    if os.getuid() == 0:
        os.setgroups([])  # none of root's groups go with it
    if libc.unshare(NAMESPACES) != 0:
        _write(to_parent, f"refused: unshare: {os.strerror(ctypes.get_errno())}\n".encode())
        _exit(0)
    _write(to_parent, b"unshared\n")
    if read_line(from_parent) != "mapped":
        _exit(1)
    os.close(from_parent)
    try:
        shown = [(p, os.open(p, os.O_PATH)) for p in outermost(job["show"])]  # still the caller's uid outside
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)  # the namespaces' root: nobody (or the caller) outside, every capability inside
        die_with_parent()  # again: a change of credentials clears it
        for path, value in NO_MORE.items():
            with open(path, "w") as f:
                f.write(value)
        new_root(shown, job["file_bytes"] * 4)
    except OSError as e:  # sealed or nothing: the code does not run
        _write(to_parent, f"failed: {e}\n".encode())
        _exit(0)
    init = os.fork()
    if init == 0:
        os.close(to_parent)
        be_init(job)
    _write(to_parent, b"sealed\n")
    os.close(to_parent)
    os.close(job["results_fd"])
    _, status = os.waitpid(init, 0)
    _exit(exit_code(status))


def outermost(paths: list[str]) -> list[str]:
    """The paths not inside another of them."""
    return [p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)]


def new_root(shown: list[tuple[str, int]], work_bytes: int) -> None:
    """The code's filesystem, then chroot into it: SYSTEM and the shown paths bound read-only where they lie (their
    parents empty directories, so nothing beside them shows), DEVICES, an empty /proc for init to mount, and a
    writable tmpfs at WORK; the rest of the root a read-only tmpfs."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"  # any directory: this mount namespace is ours
    mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755")
    os.makedirs(root + WORK)  # first: a shown path under /tmp (a clone's .venv) is bound inside it, not hidden by it
    mount("tmpfs", root + WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_bytes},mode=0700")
    binds = [(p, None) for p in SYSTEM if os.path.isdir(p) and not os.path.islink(p)]
    binds += [(p, fd) for p, fd in shown if not any(p.startswith(s + "/") for s, _ in binds)]
    for path in SYSTEM:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), root + path)
    for path, fd in binds:
        os.makedirs(root + path, exist_ok=True)
        mount(path if fd is None else f"/proc/self/fd/{fd}", root + path, None, MS_BIND | MS_REC)
        kept = os.statvfs(root + path).f_flag  # a remount must keep what is locked (noexec, the atime rule)
        mount(None, root + path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV |
              sum(ms for st, ms in KEPT_FLAGS.items() if kept & st))
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/proc")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    for _, fd in shown:
        os.close(fd)
    os.chroot(root)
    os.chdir("/")


def be_init(job: dict) -> None:
    """pid 1: this namespace's /proc, the code in a child; ends with it (the kernel then kills the rest)."""
    die_with_parent()
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    code = os.fork()
    if code == 0:
        os.chdir(WORK)
        drop_capabilities()
        run_code(job, others=2)  # init and its parent count among the namespace's processes
    os.close(job["results_fd"])
    while True:
        pid, status = os.wait()
        if pid == code:
            _exit(exit_code(status))


def drop_capabilities() -> None:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop a capability")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)())), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")


# ---- the code ----

def run_code(job: dict, others: int) -> None:
    """Under the limits (others: processes of this user that RLIMIT_NPROC counts besides the code's), the code then
    every step in order; each probe's value (or error) a record. Never returns."""
    out = job["results_fd"]
    os.set_inheritable(out, False)  # an exec'd program starts without it
    seconds = cpu_seconds(job["seconds"])
    for limit, value in ((resource.RLIMIT_CPU, (seconds, seconds + 1)), (resource.RLIMIT_AS, job["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, job["file_bytes"]), (resource.RLIMIT_NOFILE, job["open_files"]),
                         (resource.RLIMIT_NPROC, job["processes"] + others), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
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


if __name__ == "__main__":
    main()
