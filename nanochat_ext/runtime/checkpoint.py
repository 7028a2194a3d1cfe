"""Timestamped, atomic checkpoints: `model_<stamp>.pt` + `meta_<stamp>.json` (+ `state_<stamp>.pt`
with what resuming needs). The stamp is unix seconds chosen by rank 0; it sorts by time and matches
nanochat's `model_(\\d+).pt` pattern, so nanochat's own loader picks the newest too.

Every file is written under a temporary name, flushed to disk (fsync) and renamed; the meta json goes
last and marks the checkpoint complete, so a crash or power cut at any point leaves no file a reader
would take. What an earlier crashed save left behind (temporary files, models and states without a meta) is
removed at start (outdir.claim_out_dir).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanochat_ext.ddp_common import (
    broadcast_object,
    check_params_in_sync,
    gather_objects,
    get_world_size,
    is_main,
    is_sharded,
    print0,
    raise_if_any,
)
from nanochat_ext.errors import InputError, first_line

_MODEL_RE = re.compile(r"^model_(\d+)(\.pt)?$")  # a file, or a Hugging Face save_pretrained dir
_META_RE = re.compile(r"^meta_(\d+)\.json$")
_STATE_RE = re.compile(r"^state_(\d+)\.pt$")
_SHARDS_RE = re.compile(r"^shards_(\d+)$")  # a sharded training checkpoint (--parallel fsdp, parallel.py)
# nanochat's short names for its checkpoint roots under $NANOCHAT_BASE_DIR (checkpoint_manager.load_model)
SOURCE_DIRS = {"base": "base_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}
_SHORT_RE = re.compile(r"^(base|sft|rl)(?::([^/:]+))?$")


def base_dir() -> Path:
    """$NANOCHAT_BASE_DIR, else nanochat's default ~/.cache/nanochat."""
    return Path(os.environ.get("NANOCHAT_BASE_DIR") or Path.home() / ".cache" / "nanochat")


def stamp_digits(path: Path) -> str:
    """The N of model_<N>.pt, model_<N>/, shards_<N>/ or meta_<N>.json as written (nanochat zero-pads it): the
    checkpoint's other files have the same N."""
    return (_MODEL_RE.match(path.name) or _META_RE.match(path.name) or _SHARDS_RE.match(path.name)).group(1)


def complete_checkpoints(path: str | os.PathLike) -> list[tuple[Path, Path]]:
    """Every (model_<N>.pt or model_<N>/, meta_<N>.json) pair: the one named for a model path, or all
    complete pairs in a dir, largest N first. N is nanochat's zero-padded step (model_000500.pt) or
    our stamp: the meta is the one with the same digits."""
    p = Path(path)
    m = _MODEL_RE.match(p.name)
    if m and p.exists():
        meta = p.with_name(f"meta_{m.group(1)}.json")
        return [(p, meta)] if meta.is_file() else []
    if not p.is_dir():
        return []
    found = sorted(((int(m.group(1)), f.name, f) for f in p.iterdir() if (m := _MODEL_RE.match(f.name))), reverse=True)
    pairs = [(model, p / f"meta_{stamp_digits(model)}.json") for _, _, model in found]
    return [(model, meta) for model, meta in pairs if meta.is_file()]


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, Path] | None:
    """The newest complete checkpoint of complete_checkpoints(path), or None."""
    found = complete_checkpoints(path)
    return found[0] if found else None


def first_loadable(path: str | os.PathLike, load: Callable[[Path, Path], Any],
                   found: list[tuple[Path, Path]] | None = None) -> Any:
    """load(model, meta) of the newest complete checkpoint at path (or of `found`, newest first) that loads; a
    corrupt one (an InputError from load) is skipped with a warning when an older one is there to fall back on."""
    found = complete_checkpoints(path) if found is None else found
    for k, (model, meta) in enumerate(found):
        try:
            return load(model, meta)
        except InputError as e:
            if k == len(found) - 1:
                raise
            print0(f"warning: skipping a checkpoint that does not load ({e}); trying {found[k + 1][0].name}")
    raise InputError("no complete checkpoint (model_<N>.pt + meta_<N>.json)", path=str(path))


def read_json(path: str | os.PathLike, what: str = "meta") -> Any:
    """A JSON file, or one line naming it when it is not valid JSON (truncated, binary, not UTF-8)."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{what} is not valid JSON ({e})", path=str(path)) from None
    except OSError as e:
        raise InputError(f"cannot read the {what} ({e.strerror or e})", path=str(path)) from None


def check_zip(path: Path) -> None:
    """One line naming a torch checkpoint whose zip directory is unreadable (a truncated file), found
    by reading the directory at the file's end only, not the tensors."""
    try:
        zipfile.ZipFile(path).close()
    except (zipfile.BadZipFile, OSError) as e:
        raise InputError(f"cannot read the checkpoint ({e}); the file is truncated or not a torch checkpoint",
                         path=str(path)) from None


def torch_load(path: str | os.PathLike, what: str, map_location: Any = "cpu") -> Any:
    """torch.load of tensors and plain data only (weights_only: nothing in the file can run code), or one
    line naming the file when it is truncated, not a torch file, or holds other objects."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated or foreign file: torch raises many types
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            raise InputError(f"cannot read the {what}: it holds objects other than tensors and plain data, which "
                             f"are refused (loading them could run code)", path=str(path)) from None
        raise InputError(f"cannot read the {what} ({first_line(e)}); "
                         f"the file is truncated or not a torch checkpoint", path=str(path)) from None


def incomplete_reason(path: str | os.PathLike) -> str | None:
    """Why a path that looks like a checkpoint is not a complete one (a model without its meta, or a
    meta without its model); None when it does not look like one at all."""
    p = Path(path)
    if _MODEL_RE.match(p.name) and p.exists():
        return f"{p.name} has no meta_{stamp_digits(p)}.json beside it"
    if not p.is_dir():
        return None
    names = [f.name for f in p.iterdir()]
    models = sorted((int(m.group(1)), n) for n in names if (m := _MODEL_RE.match(n)))
    metas = sorted((int(m.group(1)), n) for n in names if (m := _META_RE.match(n)))
    shards = sorted((int(m.group(1)), n) for n in names
                    if (m := _SHARDS_RE.match(n)) and f"meta_{m.group(1)}.json" in names)
    if shards and (not models or shards[-1][0] > models[-1][0]):
        return (f"{shards[-1][1]} is a sharded training checkpoint (--parallel fsdp), not a model: write one from it "
                f"with the run's own command and --resume {p} --consolidate DIR")
    if models:
        return f"{models[-1][1]} has no matching meta_<N>.json (metas here: {', '.join(n for _, n in metas) or 'none'})"
    if metas:
        return f"{metas[-1][1]} has no matching model_<N>.pt"
    return None


def largest_model_tag(root: Path) -> str | None:
    """nanochat's find_largest_model: the largest d<N> subdir, else the most recently modified one."""
    tags = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    depths = [(int(m.group(1)), d.name) for d in tags if (m := re.match(r"^d(\d+)", d.name))]
    if depths:
        return max(depths)[1]
    return max(tags, key=lambda d: d.stat().st_mtime).name if tags else None


def resolve_model_path(spec: str | os.PathLike) -> Path:
    """What nanochat users type, as a path: an existing path as is (a checkpoints root such as
    chatsft_checkpoints/ resolves to its largest d<N> tag), or `base|sft|rl[:tag]` under
    $NANOCHAT_BASE_DIR (e.g. sft:d20; without a tag, the largest)."""
    p = Path(spec)
    m = _SHORT_RE.match(str(spec))
    if m and not p.exists():
        root = base_dir() / SOURCE_DIRS[m.group(1)]
        tag = m.group(2)
        if tag is None:
            tag = largest_model_tag(root)
            if tag is None:
                raise InputError(f"'{spec}': no model tags under {root} ($NANOCHAT_BASE_DIR/{SOURCE_DIRS[m.group(1)]})")
        if not (root / tag).is_dir():
            have = sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
            raise InputError(f"'{spec}': no checkpoint tag {tag!r} under {root} "
                             f"(tags there: {', '.join(have) or 'none'})")
        return root / tag
    if p.is_dir() and find_checkpoint(p) is None and incomplete_reason(p) is None \
            and not (p / "config.json").is_file():
        tag = largest_model_tag(p)  # a checkpoints root: chatsft_checkpoints/ -> chatsft_checkpoints/d20
        if tag is not None and (find_checkpoint(p / tag) is not None or incomplete_reason(p / tag)):
            return p / tag
    return p


def new_stamp(out_dir: str | os.PathLike) -> int:
    """Collective: rank 0 picks unix seconds, later than any checkpoint already in out_dir."""
    stamp = None
    if is_main():
        stamp = int(time.time())
        existing = resumable_checkpoints(out_dir)  # whole and sharded ones
        if existing:
            stamp = max(stamp, int(_META_RE.match(existing[0][1].name).group(1)) + 1)
    return broadcast_object(stamp)


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    """Rename a fully written tmp file or dir into place, durably: contents first, then the rename."""
    for f in ([tmp] if tmp.is_file() else [q for q in tmp.rglob("*") if q.is_file()] + [tmp]):
        _fsync(f)
    os.replace(tmp, path)
    _fsync(path.parent)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    _publish(tmp, path)


def _SAVE_HOOK(file_written: str) -> None:
    """Called after each file a save writes and each file removed (remove_files): fault-injection tests replace it (a
    crash in the save window, or while old checkpoints are removed)."""


def save_checkpoint(out_dir: str | os.PathLike, stamp: int, model_state: dict | Callable[[Path], None] | None,
                    meta: dict, train_state: dict | None = None) -> Path:
    """Rank 0 only. model_state is a state dict (-> model_<stamp>.pt), a function that writes a
    directory (-> model_<stamp>/, e.g. save_pretrained), or None beside a sharded checkpoint
    (shards_<stamp>/, written before). Returns the model path (the shards' where there is no model). A
    failed write (disk full, I/O error) removes every file of this stamp and raises one line with the
    free space; the previous checkpoint stays the newest complete one."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    try:
        if model_state is None:
            model_path = d / f"shards_{stamp}"
        elif callable(model_state):
            model_path = d / f"model_{stamp}"
            tmp_dir = d / f"model_{stamp}.tmp"
            shutil.rmtree(tmp_dir, ignore_errors=True)
            model_state(tmp_dir)
            _publish(tmp_dir, model_path)
        else:
            model_path = d / f"model_{stamp}.pt"
            _atomic_torch_save(model_state, model_path)
        if model_state is not None:
            _SAVE_HOOK(model_path.name)
        if train_state is not None:
            _atomic_torch_save(train_state, d / f"state_{stamp}.pt")
            _SAVE_HOOK(f"state_{stamp}.pt")
        write_json_atomic(d / f"meta_{stamp}.json", meta)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        remove_files(d, [f.name for f in d.glob(f"*_{stamp}*")], keep_going=True)  # a full disk may refuse some
        free = shutil.disk_usage(d).free / 2**20
        reason = os.strerror(e.errno) if getattr(e, "errno", None) else (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"could not write checkpoint {stamp} ({reason}); {free:.0f} MiB free there; its partial "
                         f"files were removed, the previous checkpoint is intact", path=str(d)) from None
    return model_path


def update_meta(model_path: Path, fields: dict) -> None:
    """Rank 0 only: set `fields` in a complete checkpoint's meta, atomically (the final checkpoint, saved before
    the final evaluation, then records its metrics)."""
    meta_path = model_path.parent / f"meta_{stamp_digits(model_path)}.json"
    write_json_atomic(meta_path, {**read_json(meta_path), **fields})


def write_text_atomic(path: Path, text: str) -> None:
    """path holds text, whole or not at all: written beside it, then renamed into place. An OSError leaves no
    temporary file behind (one from the directory's fsync, after the rename, leaves the new file in place)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        _publish(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    """path holds data as JSON, whole or not at all."""
    write_text_atomic(path, json.dumps(data, indent=1, default=str))


def save_synced(out_dir: str | os.PathLike, params: list[torch.Tensor], write: Callable[[int], Path],
                shards: Callable[[Path], None] | None = None) -> Path:
    """Collective save: check that every rank holds the same trainable parameters (those not sharded), let
    rank 0 pick the stamp, let every rank write its part of a sharded checkpoint into shards_<stamp>/ when
    `shards` is given (parallel.Parallel.save_shards), then rank 0 call write(stamp) -> path, which writes
    the meta last. Returns that path on every rank."""
    whole = [p for p in params if not is_sharded(p)]
    check_params_in_sync(whole)
    if get_world_size() > 1 and len(whole) == len(params):
        print0(f"ddp: trainable parameters identical on {get_world_size()} ranks")
    stamp = new_stamp(out_dir)
    if shards is not None:
        _write_shards(Path(out_dir), stamp, shards)
    path, error = None, None
    if is_main():
        try:
            path = write(stamp)
        except InputError as e:
            error = str(e)
    raise_if_any(error)
    return broadcast_object(path)


def _write_shards(d: Path, stamp: int, shards: Callable[[Path], None]) -> None:
    """Collective: every rank writes into shards_<stamp>.tmp/, then rank 0 makes it durable and renames it to
    shards_<stamp>/. A failure on any rank removes the directory and is one line on every rank."""
    tmp, error = d / f"shards_{stamp}.tmp", None
    try:
        shards(tmp)
    except OSError as e:
        error = e.strerror or first_line(e, 200)
    except Exception as e:  # torch.distributed.checkpoint wraps a rank's failure in its own type for the others
        error = first_line(e, 200)
    error = next((e for e in gather_objects(error) if e), None)
    if is_main() and error is None:
        try:
            error = missing_shards(tmp)
            if error is None:
                _publish(tmp, d / f"shards_{stamp}")
        except OSError as e:
            error = e.strerror or str(e)
    error = broadcast_object(error)
    if error is not None:
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(d).free / 2**20
        raise_if_any(f"{d}: could not write sharded checkpoint {stamp} ({error}); {free:.0f} MiB free there; "
                     f"its partial files were removed, the previous checkpoint is intact")


def missing_shards(path: Path) -> str | None:
    """Why a sharded checkpoint's directory is not whole (no .metadata, or a shard file it names is absent: ranks
    that wrote to disks of their own, not one every rank shares), or None."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # absent or garbled: torch raises its own types
        return f"its .metadata does not read ({first_line(e, 120)})"
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    absent = sorted(f for f in files if not (path / f).is_file())
    if absent:
        return (f"shard files {', '.join(absent[:3])} are not in {path.name}: under --parallel fsdp --out must be a "
                f"directory every rank shares")
    return None


def is_shards(path: str | os.PathLike) -> bool:
    """Whether path is a sharded training checkpoint's directory (shards_<stamp>/)."""
    return bool(_SHARDS_RE.match(Path(path).name))


def resumable_checkpoints(path: str | os.PathLike) -> list[tuple[Path, Path]]:
    """complete_checkpoints(path) and the sharded ones (shards_<N>/ + meta_<N>.json), newest first; where a
    stamp has both (an fsdp run's final checkpoint) its shards, which hold the optimizer state."""
    p = Path(path)
    if _SHARDS_RE.match(p.name):
        meta = p.with_name(f"meta_{_SHARDS_RE.match(p.name).group(1)}.json")
        return [(p, meta)] if p.is_dir() and meta.is_file() else []
    found = {int(stamp_digits(m)): (m, meta) for m, meta in complete_checkpoints(p)}
    if p.is_dir() and not _MODEL_RE.match(p.name):
        for f in p.iterdir():
            if (m := _SHARDS_RE.match(f.name)) and (p / f"meta_{m.group(1)}.json").is_file():
                found[int(m.group(1))] = (f, p / f"meta_{m.group(1)}.json")
    return [found[k] for k in sorted(found, reverse=True)]


def remove_orphans(out_dir: Path) -> list[str]:
    """What a crashed save leaves: *.tmp files and dirs, and models or states without their meta.
    Removed; returns their names."""
    if not out_dir.is_dir():
        return []
    names = {f.name for f in out_dir.iterdir()}
    orphans = [n for n in names if n.endswith(".tmp")]
    for n in names:
        m = _MODEL_RE.match(n) or _STATE_RE.match(n) or _SHARDS_RE.match(n)
        if m and f"meta_{m.group(1)}.json" not in names:
            orphans.append(n)
    return sorted(remove_files(out_dir, orphans, keep_going=True))  # what cannot go stays, and is not named


def remove_files(d: Path, names: list[str], keep_going: bool = False) -> list[str]:
    """Remove these files and dirs of d, in order (a dir renamed to *.tmp first, so that a kill part-way through its
    contents leaves a name remove_orphans takes, not a partial dir under a checkpoint's name). Returns those removed.
    An OSError stops the removal (the order matters), or with keep_going skips that name."""
    removed = []
    for name in names:
        f = d / name
        try:
            if f.is_dir():
                if not name.endswith(".tmp"):
                    f = f.rename(d / f"{name}.tmp")
                shutil.rmtree(f)
            elif f.exists():
                f.unlink()
            else:
                continue
        except OSError:
            if keep_going:
                continue
            raise
        removed.append(name)
        _SAVE_HOOK(f"removed {name}")
    return removed


# ---- checkpoints that travel ------------------------------------------------------------------------
FINGERPRINT_WINDOWS, FINGERPRINT_WINDOW = 64, 1 << 16


def fingerprint(path: str | os.PathLike) -> str:
    """What identifies a model's weights, fast for any size: sha256 over each weight file's size and 64
    windows of 64 KiB spread evenly through it (4 MiB read per file, whatever its size). Retraining
    changes the bytes everywhere, so a different model of the same shape is caught; a file copied or
    moved keeps its fingerprint. A model dir (Hugging Face) hashes its weight files in name order."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt")) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name if p.is_dir() else ''}:{size}".encode())
        with open(f, "rb") as fh:
            for k in range(FINGERPRINT_WINDOWS):
                fh.seek(max(0, (size - FINGERPRINT_WINDOW) * k // max(FINGERPRINT_WINDOWS - 1, 1)))
                h.update(fh.read(FINGERPRINT_WINDOW))
    return "sha256-sampled:" + h.hexdigest()


def portable_paths(target: str | os.PathLike, anchor_dir: str | os.PathLike) -> dict[str, str | None]:
    """How a checkpoint refers to a file it depends on: the absolute path, the path relative to the
    checkpoint's own dir, and relative to $NANOCHAT_BASE_DIR when the file lies under it."""
    t = Path(target).resolve()
    base = base_dir().resolve()
    return {"path": str(t), "relative_to_checkpoint": os.path.relpath(t, Path(anchor_dir).resolve()),
            "relative_to_base_dir": str(t.relative_to(base)) if t.is_relative_to(base) else None}


def locate(ref: dict, anchor_dir: str | os.PathLike) -> Path | None:
    """The first of portable_paths' candidates that exists: relative to the checkpoint's dir (moved
    together), then to today's $NANOCHAT_BASE_DIR, then the absolute path."""
    candidates = [Path(anchor_dir) / ref["relative_to_checkpoint"] if ref.get("relative_to_checkpoint") else None,
                  base_dir() / ref["relative_to_base_dir"] if ref.get("relative_to_base_dir") else None,
                  Path(ref["path"]) if ref.get("path") else None]
    return next((c.resolve() for c in candidates if c is not None and c.exists()), None)
