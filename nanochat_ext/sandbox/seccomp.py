"""The sandbox's seccomp filter, compiled once per process by libseccomp (through pyseccomp) into a BPF program that
the sandbox's code process loads itself (sandbox/code_process.py): the sandbox starts no binding, only a prctl.

It refuses, with EPERM, the system calls the code has no use for and the kernel's riskiest surface: the keyring's
calls, ptrace and process_vm_*, kcmp, bpf, perf_event_open, userfaultfd, io_uring, the mount family, chroot,
namespaces (unshare, setns, and clone's namespace flags; clone3, whose flags hide behind a pointer, answers ENOSYS so
that libc falls back to clone), modules, kexec, reboot, swap, acct, quotactl, syslog, file handles, fanotify,
iopl/ioperm and personality, System V and POSIX IPC (memory that outlives the sandbox), a signal to pid -1 (every
process of its user: unsealed, other rows' sandboxes); and every socket family but AF_UNIX (AF_VSOCK, AF_NETLINK and
AF_INET included: no network behind the network namespace either). A call of another ABI (32-bit int 0x80 on
x86_64) kills the process: libseccomp's default for a foreign architecture.
"""
from __future__ import annotations

import errno
import functools
import os
import socket

try:
    import pyseccomp
except Exception as e:  # not installed, or no libseccomp.so.2 on this machine
    pyseccomp, MISSING = None, f"{type(e).__name__}: {e}"

DENIED = ("keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "bpf",
          "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "mount", "umount2",
          "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
          "mount_setattr", "unshare", "setns", "init_module", "finit_module", "delete_module", "kexec_load",
          "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "name_to_handle_at",
          "open_by_handle_at", "fanotify_init", "lookup_dcookie", "iopl", "ioperm", "personality", "vhangup",
          "shmget", "msgget", "semget", "mq_open")  # System V and POSIX IPC: memory that outlives the sandbox
NEW_NAMESPACE = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl call's number, where libseccomp is not there to say it



@functools.cache
def program() -> tuple[bytes, int | None, str]:
    """(the filter's BPF program, the keyctl call's number on this machine, "") where libseccomp builds it, else
    (b"", None, why not): what the sandbox's start line says. Built in the caller, once: the sandbox's processes
    only load it."""
    if pyseccomp is None:
        return b"", KEYCTL.get(os.uname().machine), f"no seccomp filter (pyseccomp: {MISSING})"
    try:
        f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        for name in DENIED:
            try:
                f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
            except (ValueError, OSError):  # a call this architecture does not have (iopl on arm64)
                pass
        for call in ("socket", "socketpair"):
            f.add_rule(pyseccomp.ERRNO(errno.EAFNOSUPPORT), call, pyseccomp.Arg(0, pyseccomp.NE, socket.AF_UNIX))
        for flag in NEW_NAMESPACE:  # clone's flags are its first argument on the architectures we know
            f.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
        f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
        # kill(-1, ...): every process of its user (unsealed: other rows' sandboxes too)
        f.add_rule(pyseccomp.ERRNO(errno.EPERM), "kill", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0xFFFFFFFF, 0xFFFFFFFF))
        read, write = os.pipe()
        try:
            with os.fdopen(write, "wb") as out:
                f.export_bpf(out)
            with os.fdopen(read, "rb") as got:
                bpf = got.read()
        except BaseException:
            os.close(read)
            raise
        keyctl = pyseccomp.resolve_syscall(pyseccomp.system_arch(), "keyctl")
        return bpf, int(keyctl) if keyctl is not None and keyctl >= 0 else None, ""
    except Exception as e:  # libseccomp refused to build it
        return b"", None, f"no seccomp filter ({type(e).__name__}: {e})"
