"""The sandbox's side of the wall: runtime/sandbox.py starts this file as `python -I sandbox_child.py`, it seals
itself off, runs the untrusted code, then the steps the caller asked for, and writes what each probe gave on a
pipe. The standard library only; the job is read from stdin before any untrusted line runs.

The processes, outermost first:

    supervisor  the caller's child: enforces the wall clock, and at the end kills every process below it (it is
                their subreaper); it maps the namespaces' uid from outside (nobody where the caller is root, so
                that RLIMIT_NPROC binds and nothing of root's is writable)
    namespaces  unshares user, mount, pid, network, IPC and UTS namespaces; makes every mount read-only, hides
                $HOME, /root, /tmp, /var/tmp, /dev/shm and /run behind empty tmpfs (the Python installation bound
                back where it lies under one), and mounts a tmpfs of the code's own at /tmp/sandbox
    init        pid 1 of the new pid namespace: when the code's process ends, it ends, and the kernel kills every
                process left in the namespace
    code        every capability dropped, no new privileges, the limits set, stdin /dev/null: the untrusted code

Where the OS refuses namespaces, the supervisor's child runs the code in a temporary directory under the limits
(as nobody where the caller is root and the Python installation is readable by others): not sealed from the
filesystem or the network, and the caller says so.

The results pipe carries one JSON line a record, {"step": k, "value": ...} or {"step": k, "error": "..."}: what
the code's process says, so nothing the caller trusts; the verdict is the caller's, from the values it compares.
The report pipe, which the code never holds, says whether the namespaces were made ("sealed" or "refused: why").
"""
import builtins
import ctypes
import json
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
import time

libc = ctypes.CDLL(None, use_errno=True)
NAMESPACES = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000  # NS UTS IPC USER PID NET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
KEPT_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: 1024,
              os.ST_NODIRATIME: 2048, os.ST_RELATIME: 1 << 21}  # a remount must keep these: they are locked
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
NOBODY = 65534
WORK = "/tmp/sandbox"  # the code's directory, its $HOME and $TMPDIR
HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/root")  # covered by empty tmpfs, and $HOME
TIMED_OUT = 124  # the supervisor's exit code when the wall clock ended the run
MAX_VALUE = 64 << 10  # bytes of one encoded value
PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


# ---- the supervisor ----

def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    job["show"] = python_paths()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the caller gone: so are we, and all below
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the code stay ours to end
    report = job["report_fd"]
    os.set_inheritable(report, False)
    workdir = None
    said = "off"
    child = sealed_child(job) if job["isolate"] else None
    if isinstance(child, str):  # refused: the code runs unsealed; failed: it does not run
        said, child = child, None
        if said.startswith("failed"):
            os.write(report, f"{said}\n".encode())
            os._exit(0)
    elif child is not None:
        said = "sealed"
    if child is None:
        workdir = tempfile.mkdtemp(prefix="sandbox-")
        nobody = os.getuid() == 0 and readable_by_others(job["show"])
        if nobody:
            os.chown(workdir, NOBODY, NOBODY)
        child = os.fork()
        if child == 0:
            os.close(report)
            os.chdir(workdir)
            run_code(job, sealed=False, drop_to_nobody=nobody)
    os.write(report, f"{said}\n".encode())
    os.close(report)
    os.close(job["results_fd"])
    signal.signal(signal.SIGALRM, lambda *_: end(TIMED_OUT, workdir))
    signal.setitimer(signal.ITIMER_REAL, job["seconds"])
    _, status = os.waitpid(child, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    end(exit_code(status), workdir)


def python_paths() -> list[str]:
    """Where this interpreter's standard library and packages lie: what the code may read even under a hidden
    directory (this file's own directory left out)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *sys.path[1:]}
    return sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})


def sealed_child(job: dict):
    """The namespaces' first process, sealed: its uid mapped from here (only a process outside may map another uid
    than its own). Or, where the namespaces are refused or the sealing fails, why."""
    to_parent, to_child = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:
        for fd in (job["report_fd"], to_parent[0], to_child[1]):
            os.close(fd)
        namespaces(job, to_parent[1], to_child[0])  # never returns
    said = read_line(to_parent[0])
    if said == "unshared":
        uid, gid = (NOBODY, NOBODY) if os.getuid() == 0 else (os.getuid(), os.getgid())
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/{child}/{name}", "w") as f:
                    f.write(text)
            os.write(to_child[1], b"mapped\n")
            said = read_line(to_parent[0])
        except OSError as e:
            os.kill(child, signal.SIGKILL)
            said = f"refused: the uid map: {e.strerror}"
    for fd in (*to_parent, *to_child):
        os.close(fd)
    if said == "sealed":
        return child
    os.waitpid(child, 0)
    return said or "failed: the namespaces' process ended"


def end(code: int, workdir: str | None) -> None:
    """Kill every process below us (a pid namespace goes with its init), reap them, remove the unsealed run's
    directory, and exit with the code's status: its exit code, 128 + the signal that ended it, or TIMED_OUT."""
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
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    os._exit(min(code, 255))


def reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


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
    """Whether nobody could read the Python installation (a pyenv under /root: no)."""
    def readable(p: str) -> bool:
        need = 0o005 if os.path.isdir(p) else 0o004
        return not not_traversable([p]) and os.stat(p).st_mode & need == need
    return all(readable(p) for p in paths)


# ---- inside the namespaces ----

def namespaces(job: dict, to_parent: int, from_parent: int) -> None:
    if libc.unshare(NAMESPACES) != 0:
        os.write(to_parent, f"refused: unshare: {os.strerror(ctypes.get_errno())}\n".encode())
        os._exit(0)
    os.write(to_parent, b"unshared\n")
    if read_line(from_parent) != "mapped":
        os._exit(1)
    os.close(from_parent)
    try:
        covers = plan_covers(job["show"])  # still the caller's uid outside: it may enter what nobody may not
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)  # the namespaces' root: nobody (or the caller) outside, every capability inside
        seal_filesystem(covers, job["file_bytes"] * 4)
    except OSError as e:  # sealed or nothing: the code does not run
        os.write(to_parent, f"failed: {e}\n".encode())
        os._exit(0)
    init = os.fork()
    if init == 0:
        os.close(to_parent)
        be_init(job)
    os.write(to_parent, b"sealed\n")
    os.close(to_parent)
    os.close(job["results_fd"])
    _, status = os.waitpid(init, 0)
    os._exit(exit_code(status))


def plan_covers(shown: list[str]) -> list[tuple[str, list[tuple[str, int, bool]]]]:
    """The directories to hide behind an empty tmpfs (the writable places, the home directories, and any directory
    above the Python installation that others may not enter), shallowest first, each with what to bind back into it:
    (path, an O_PATH descriptor of it, whether it is a directory)."""
    if os.path.islink("/tmp") or not os.path.isdir("/tmp"):
        raise OSError(0, "/tmp is not a directory to cover")
    hidden = {d for d in (*HIDDEN, os.path.expanduser("~"), *not_traversable(shown))
              if os.path.isdir(d) and not os.path.islink(d) and d != "/"}
    plan = []
    for d in sorted(hidden, key=lambda d: d.count("/")):
        keep = sorted({os.path.join(d, os.path.relpath(p, d).split(os.sep)[0]) for p in shown
                       if p.startswith(d.rstrip("/") + "/") and os.path.exists(p)})
        plan.append((d, [(k, os.open(k, os.O_PATH), os.path.isdir(k)) for k in keep]))
    return plan


def seal_filesystem(covers: list[tuple[str, list[tuple[str, int, bool]]]], work_bytes: int) -> None:
    """The covers mounted, what they keep bound back in; then every mount read-only, and the code's directory a
    tmpfs of its own."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for d, keep in covers:
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for k, fd, is_dir in keep:
            if is_dir:
                os.makedirs(k, exist_ok=True)
            else:
                open(k, "w").close()
            mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
            os.close(fd)
    os.makedirs(WORK, exist_ok=True)
    for mp in mount_points():
        try:
            flags = os.statvfs(mp).f_flag
        except OSError:
            continue  # a mount that cannot be reached here cannot be reached by the code either
        mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | sum(ms for st, ms in KEPT_FLAGS.items() if flags & st))
    mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_bytes},mode=0700")


def mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def not_traversable(paths: list[str]) -> list[str]:
    """Directories above the paths that others may not enter (a pyenv under /root)."""
    out = []
    for p in paths:
        parts = p.split("/")
        for k in range(2, len(parts)):
            d = "/".join(parts[:k])
            try:
                if not os.stat(d).st_mode & 0o001:
                    out.append(d)
            except OSError:
                break
    return out


def be_init(job: dict) -> None:
    """pid 1: this namespace's /proc, the code in a child; ends with it (the kernel then kills the rest)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    code = os.fork()
    if code == 0:
        os.chdir(WORK)
        drop_capabilities()
        run_code(job, sealed=True)
    os.close(job["results_fd"])
    while True:
        pid, status = os.wait()
        if pid == code:
            os._exit(exit_code(status))


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

def run_code(job: dict, sealed: bool, drop_to_nobody: bool = False) -> None:
    """Under the limits, the code then every step in order; each probe's value (or error) a record. Never returns."""
    out = job["results_fd"]
    os.set_inheritable(out, False)  # an exec'd program starts without it
    if drop_to_nobody:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    seconds = max(int(job["seconds"] + 0.999), 1)
    helpers = 2 if sealed else 0  # sealed, init and its parent share the namespace's count
    for limit, value in ((resource.RLIMIT_CPU, (seconds, seconds + 1)), (resource.RLIMIT_AS, job["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, job["file_bytes"]), (resource.RLIMIT_NOFILE, job["open_files"]),
                         (resource.RLIMIT_NPROC, job["processes"] + helpers), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
    os.environ.clear()
    os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=os.getcwd(), TMPDIR=os.getcwd(), LANG="C.UTF-8")
    os.umask(0o077)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    steps = [("exec", job["code"], "the code")] + [tuple(s) for s in job["steps"]]
    for k, (kind, source, what) in enumerate(steps):
        try:
            if kind == "exec":
                exec(compile(source, what, "exec"), namespace)
                continue
            value = eval(compile(source, what, "eval"), namespace)
        except SystemExit as e:
            record(out, {"step": k, "error": f"exited (SystemExit: {shown(e.code)})"})
            if kind == "exec":
                break
            continue
        except BaseException as e:  # the untrusted code's failure: what the caller shows the model
            record(out, {"step": k, "error": f"raised {described(e)}"})
            if kind == "exec":
                break
            continue
        try:
            value = encode(bool(value) if kind == "truth" else value)
            too_big = len(json.dumps(value)) > MAX_VALUE
            record(out, {"step": k, "error": f"returned a value over {MAX_VALUE >> 10} KB"} if too_big else
                   {"step": k, "value": value})
        except ValueError as e:
            record(out, {"step": k, "error": str(e)})
        except BaseException as e:  # bool() of the code's object raised
            record(out, {"step": k, "error": f"raised {described(e)}"})
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)  # no exit hook of the code's runs


def record(fd: int, rec: dict) -> None:
    data = (json.dumps(rec) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def encode(value, depth: int = 0):
    """A plain value (exactly one of PLAIN's types, not a subclass: no __eq__ of the code's) as tagged JSON:
    ["int", "5"], ["list", [...]], ...; ValueError for anything else."""
    kind = type(value)
    if kind not in PLAIN:
        raise ValueError(f"returned {kind.__name__}, not a plain value (int, float, str, bytes, bool, None, or a "
                         f"list, tuple, dict or set of them)")
    if depth > 40:
        raise ValueError("returned a value nested too deep")
    name = kind.__name__
    if kind in (list, tuple, set, frozenset):
        return [name, [encode(v, depth + 1) for v in value]]
    if kind is dict:
        return [name, [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if kind is float:
        return [name, value.hex()]
    if kind is complex:
        return [name, [value.real.hex(), value.imag.hex()]]
    if kind is bytes:
        return [name, value.hex()]
    if kind is int:
        if value.bit_length() > 8 * MAX_VALUE:
            raise ValueError("returned an int too large to check")
        return [name, hex(value)]
    return [name, value]  # str, bool, None


def shown(value) -> str:
    try:
        return repr(value)[:100] if type(value) in PLAIN else type(value).__name__
    except BaseException:
        return type(value).__name__


def described(e: BaseException) -> str:
    try:
        text = str(e)
    except BaseException:
        text = ""
    name = type(e).__name__
    if isinstance(e, SyntaxError) and e.lineno:
        text = f"{e.msg} (line {e.lineno})"
    return f"{name}: {text}"[:300] if text else name


if __name__ == "__main__":
    main()
