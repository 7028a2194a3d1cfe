"""A run's output dir: the lock that makes it one run's, what crashed saves left removed at start, and --keep_last,
the checkpoints a run keeps there.

--keep_last: a checkpoint of an SFT-sized model with its optimizer state is three times the model (fp32 weights,
AdamW's two moments), so a long run that saves every N steps keeps the newest few whole and removes the rest as it
goes, as TRL's save_total_limit does. What stays: the `keep_last` newest complete checkpoints of this trainer's kind,
whole (one to resume from, one to fall back on when the newest does not load), every final model (the step its run
was asked to reach: another stage may read it) with its meta, and whatever this trainer did not write (nanochat's
checkpoints, another kind's). What goes, from older checkpoints: resume states, shards and the models of periodic
saves. An older checkpoint loses its meta first, so a crash part-way leaves files without a meta, which the next start
removes (checkpoint.remove_orphans), and never touches the checkpoints kept. Pruning is best effort: what cannot be
read or removed is left, with a warning.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from nanochat_ext.ddp_common import get_rank, is_main, print0, raise_if_any
from nanochat_ext.errors import InputError
from nanochat_ext.runtime import console
from nanochat_ext.runtime.checkpoint import read_json, remove_files, remove_orphans, resumable_checkpoints, stamp_digits

LOCK_FILE = ".lock"
KEEP_LAST_HELP = ("keep the N newest complete checkpoints in --out and remove older resume states, shards and periodic "
                  "models once a newer checkpoint is complete; final models stay (0: keep everything) (default: "
                  "%(default)s)")


def prune(out_dir: Path, keep_last: int, kind: str) -> list[str]:
    """Rank 0 only, after a checkpoint is published: remove what --keep_last does not keep of this trainer's `kind`
    (the module docstring). Returns the names removed, in order."""
    if keep_last == 0:
        return []
    removed: list[str] = []
    ours = [meta_path for _, meta_path in resumable_checkpoints(out_dir) if _meta(meta_path).get("kind") == kind]
    for meta_path in ours[keep_last:]:
        meta, digits = _meta(meta_path), stamp_digits(meta_path)
        doomed = [f"state_{digits}.pt", f"shards_{digits}"]
        if meta.get("step") != (meta.get("args") or {}).get("max_steps"):  # not a final model: all of it, meta first
            doomed = [meta_path.name, *doomed, f"model_{digits}.pt", f"model_{digits}"]
        try:
            removed += remove_files(out_dir, doomed)
        except OSError as e:
            print0(f"warning: keep_last: could not remove all of checkpoint {digits} ({e.strerror or e}); the rest "
                   f"of it stays")
    return removed


def _meta(path: Path) -> dict:
    """A meta's fields; none for one that does not read (it is then kept)."""
    try:
        meta = read_json(path)
    except InputError:
        return {}
    return meta if isinstance(meta, dict) else {}


_LOCKS: list[Any] = []  # open lock files of this process's runs, released by release_out_dirs()
run_log_dir: Path | None = None  # the log dir of the run this process is in, once claimed (keep_traceback's)
_kept: set[Path] = set()  # the traceback files this run wrote
_kept_lock = threading.Lock()


def _lock(out_dir: Path) -> str | None:
    """Take the run lock on out_dir (flock, released by the OS on any exit); an error line if held."""
    f = open(out_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        return (f"{out_dir}: another run is using this output dir (lock held by {holder}); wait for it to "
                f"finish or give another --out")
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _LOCKS.append(f)
    return None


def release_out_dirs() -> None:
    global run_log_dir
    run_log_dir = None
    _kept.clear()
    while _LOCKS:
        _LOCKS.pop().close()


def claim_out_dir(out_dir: str | os.PathLike, log_dir: str | os.PathLike | None = None) -> None:
    """Collective, once the inputs are checked: rank 0 makes out_dir (and log_dir: the run's, where
    keep_traceback writes and every rank's printed lines are kept, console.log), checks they can be written, locks
    out_dir for this run and removes what crashed saves left there."""
    global run_log_dir
    error = None
    if log_dir is not None:
        run_log_dir = Path(log_dir)
    if is_main():
        error = check_writable(out_dir) or (check_writable(log_dir) if log_dir is not None else None)
        error = error or _lock(Path(out_dir))
        if error is None and (removed := remove_orphans(Path(out_dir))):
            print0(f"checkpoint: removed what an interrupted save left: {', '.join(removed)}")
    raise_if_any(error)
    if log_dir is not None:
        console.keep_in(Path(log_dir), get_rank())


def keep_traceback(error: BaseException) -> str:
    """The traceback of the user's code that raised `error` (a reward function), which a one-line error cannot hold,
    written by this rank into the run's log dir as traceback_rank<r>.txt (the run's first such one; any rank makes the
    dir it lacks), and named for the line: ' (its traceback: PATH)'. Where no log dir is claimed, or it cannot be
    written, the traceback goes to stderr and the line names nothing."""
    text = "".join(traceback.format_exception(error))
    path = run_log_dir / f"traceback_rank{get_rank()}.txt" if run_log_dir is not None else None
    try:
        with _kept_lock:  # reward threads: the first failure's traceback is the file's
            if path is not None and path not in _kept:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                _kept.add(path)
    except OSError:
        path = None
    if path is None:
        sys.stderr.write(text)
        return ""
    return f" (its traceback: {path})"


def check_writable(out_dir: str | os.PathLike) -> str | None:
    """An error message if out_dir cannot be created or written, else None. Leaves nothing behind
    but the directory itself."""
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"{d}: dir cannot be written ({e.strerror or e})"
    return None
