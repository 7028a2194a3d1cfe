"""A cgroup of a sandbox's own, where this machine lets the caller make one: the memory of all its processes together
(the kernel's own for them too: a tmpfs's inodes, xattrs, pipes, page tables) under `memory`, its processes under
`pids`, and every process in it killed at the end, however it left the supervisor's process tree.

cgroup v2 where the caller's cgroup has the memory and pids controllers enabled for its children (a delegated scope:
systemd's Delegate=yes, a container runtime's; enabling them is left to the host, as cgroup v2 refuses it to a
cgroup that holds processes), else the v1 memory and pids hierarchies where they are mounted and writable (the
caller root, as in most containers). Where neither is, `make` says why and the sandbox's memory is bounded per
process only (RLIMIT_AS).

Nothing made here outlives the process that made it: each cgroup is removed when its sandbox ends, and at the
process's exit `remove_all` kills and removes any still there (a sandbox whose thread the run left behind: a tool call
past its timeout when the run ended). Its cgroups are named after its pid, and it only ever removes its own.
"""
from __future__ import annotations

import atexit
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass

_names = itertools.count()
# How long a removal waits for the kernel to let a just-emptied cgroup go: briefly when a sandbox call ends (its
# caller's clock runs), longer at exit, where what a call left is tried again.
CALL_WAIT_S, EXIT_WAIT_S = 1.0, 5.0
_lock = threading.RLock()  # make holds it while a failed v1 cgroup is removed
_live: set[tuple[str, ...]] = set()  # this process's cgroups not yet removed
_closing = False  # set at exit: no new cgroup after the sweep began


def _forget_in_child() -> None:
    """A forked child starts with no cgroup of its own and a free lock (another thread may have held it)."""
    global _lock, _live, _closing
    _lock, _live, _closing = threading.RLock(), set(), False


os.register_at_fork(after_in_child=_forget_in_child)


def mounts() -> dict[str, str]:
    """{"2": the cgroup2 mount, "memory": the v1 memory hierarchy's mount, "pids": ...} on this machine."""
    found = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                fstype, options = fields[sep + 1], fields[sep + 3].split(",") if len(fields) > sep + 3 else []
                if fstype == "cgroup2":
                    found.setdefault("2", fields[4])
                elif fstype == "cgroup":
                    for controller in ("memory", "pids"):
                        if controller in options:
                            found.setdefault(controller, fields[4])
    except (OSError, ValueError):
        pass
    return found


def own_paths() -> dict[str, str]:
    """This process's cgroup in each hierarchy: {"2": "/...", "memory": "/...", "pids": "/..."}."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0":
                paths["2"] = path
            for c in controllers.split(","):
                if c in ("memory", "pids"):
                    paths[c] = path
    return paths


@dataclass
class Cgroup:
    dirs: list[str]  # one (v2) or two (v1: memory, pids) directories

    def add(self, pid: int) -> None:
        """Move a process in (before it starts anything: what it starts is counted with it)."""
        for d in self.dirs:
            write(os.path.join(d, "cgroup.procs"), str(pid))

    def kill(self) -> None:
        """Kill every process in it until none is left (v2's cgroup.kill where there is one, and its
        cgroup.events' `populated 0` as the sign that none is: v1's an empty cgroup.procs)."""
        for _ in range(200):
            pids = set()
            for d in self.dirs:
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids |= {int(p) for p in f.read().split()}
                except OSError:
                    continue
            if not pids and not any(map(populated, self.dirs)):
                return
            try:  # (another remover's rmdir may come between: at exit, the sandbox's thread and remove_all)
                if os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
                    write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
            except OSError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)

    def remove(self, wait_s: float = CALL_WAIT_S) -> None:
        """Kill what is in it and remove its directories, waiting up to wait_s for the kernel to let each go (a
        killed process leaves its cgroup once it is reaped); one it still holds is left to remove_all."""
        self.kill()
        gone = True
        for d in self.dirs:
            deadline, pause = time.monotonic() + wait_s, 0.005
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        gone = False
                        break
                    time.sleep(pause)
                    pause = min(2 * pause, 0.2)
        if gone:
            with _lock:
                _live.discard(tuple(self.dirs))


def populated(d: str) -> bool:
    """cgroup v2's own word on whether any process is left in d or below (False where there is no cgroup.events)."""
    try:
        with open(os.path.join(d, "cgroup.events")) as f:
            return "populated 1" in f.read().splitlines()
    except OSError:
        return False


@atexit.register
def remove_all() -> None:
    """Kill and remove every cgroup this process made that is still there; no cgroup is made after it began."""
    global _closing
    with _lock:
        _closing = True
        mine = f"nanochat-sandbox-{os.getpid()}-"  # a forked child that exits normally holds its parent's list
        left = [dirs for dirs in _live if os.path.basename(dirs[0]).startswith(mine)]
    for dirs in left:
        try:
            Cgroup(list(dirs)).remove(EXIT_WAIT_S)
        except OSError:  # one cgroup the kernel keeps does not keep the others
            pass


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def make(memory_bytes: int, pids: int) -> tuple[Cgroup | None, str]:
    """A new cgroup bounding memory and processes, and what bounds them ("cgroup v2", "cgroup v1"), or (None, why
    not)."""
    with _lock:  # made and registered at once: remove_all sees every cgroup made before it began
        if _closing:
            return None, "no cgroup: the process is exiting"
        made, why = make_unregistered(memory_bytes, pids)
        if made:
            _live.add(tuple(made.dirs))
        return made, why


def make_unregistered(memory_bytes: int, pids: int) -> tuple[Cgroup | None, str]:
    try:
        where, own = mounts(), own_paths()
    except OSError as e:
        return None, f"no cgroup ({e.strerror})"
    name = f"nanochat-sandbox-{os.getpid()}-{next(_names)}"
    why = "no cgroup hierarchy with memory and pids"
    if "2" in where and "2" in own:
        parent = os.path.join(where["2"], own["2"].lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if not {"memory", "pids"} <= set(enabled):  # enabling them is the host's to do, not ours (a cgroup
                raise OSError(0, "memory and pids are not delegated to the trainer's cgroup")  # holding us cannot)
            d = os.path.join(parent, name)
            os.mkdir(d)
            try:
                write(os.path.join(d, "memory.max"), str(memory_bytes))
                write(os.path.join(d, "memory.swap.max"), "0") if os.path.exists(os.path.join(d, "memory.swap.max")) \
                    else None
                write(os.path.join(d, "pids.max"), str(pids))
            except OSError:
                os.rmdir(d)
                raise
            return Cgroup([d]), "cgroup v2"
        except OSError as e:
            why = f"cgroup v2 does not delegate memory and pids here ({e.strerror})"
    if "memory" in where and "pids" in where and "memory" in own and "pids" in own:
        made = []
        try:
            for controller in ("memory", "pids"):
                d = os.path.join(where[controller], own[controller].lstrip("/"), name)
                os.mkdir(d)
                made.append(d)
            write(os.path.join(made[0], "memory.limit_in_bytes"), str(memory_bytes))
            write(os.path.join(made[1], "pids.max"), str(pids))
            return Cgroup(made), "cgroup v1"
        except OSError as e:
            Cgroup(made).remove()
            why += f"; cgroup v1: {e.strerror}"
    return None, why
