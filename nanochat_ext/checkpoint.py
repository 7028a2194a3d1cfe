"""Timestamped, atomic checkpoints: `model_<stamp>.pt` + `meta_<stamp>.json` (+ `state_<stamp>.pt`
with what resuming needs). The stamp is unix seconds chosen by rank 0; it sorts by time and matches
nanochat's `model_(\\d+).pt` pattern, so nanochat's own loader picks the newest too.

Every file is written under a temporary name and renamed; the meta json goes last and marks the
checkpoint complete, so a crash at any point leaves no file a reader would take.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from nanochat_ext.ddp_common import broadcast_object, check_params_in_sync, get_world_size, is_main, print0
from nanochat_ext.errors import InputError

_MODEL_RE = re.compile(r"^model_(\d+)(\.pt)?$")  # a file, or a Hugging Face save_pretrained dir
_META_RE = re.compile(r"^meta_(\d+)\.json$")
# nanochat's short names for its checkpoint roots under $NANOCHAT_BASE_DIR (checkpoint_manager.load_model)
SOURCE_DIRS = {"base": "base_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}
_SHORT_RE = re.compile(r"^(base|sft|rl)(?::([^/:]+))?$")


def base_dir() -> Path:
    """$NANOCHAT_BASE_DIR, else nanochat's default ~/.cache/nanochat."""
    return Path(os.environ.get("NANOCHAT_BASE_DIR") or Path.home() / ".cache" / "nanochat")


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, Path] | None:
    """(model_<N>.pt or model_<N>/, meta_<N>.json) for a model path, or the complete pair with the
    largest N in a dir; else None. N is nanochat's zero-padded step (model_000500.pt) or our stamp:
    the meta is the one with the same digits."""
    p = Path(path)
    m = _MODEL_RE.match(p.name)
    if m and p.exists():
        meta = p.with_name(f"meta_{m.group(1)}.json")
        return (p, meta) if meta.is_file() else None
    if not p.is_dir():
        return None
    found = sorted((int(m.group(1)), f.name, f) for f in p.iterdir() if (m := _MODEL_RE.match(f.name)))
    for _, _, model in reversed(found):
        meta = p / f"meta_{_MODEL_RE.match(model.name).group(1)}.json"
        if meta.is_file():
            return model, meta
    return None


def incomplete_reason(path: str | os.PathLike) -> str | None:
    """Why a path that looks like a checkpoint is not a complete one (a model without its meta, or a
    meta without its model); None when it does not look like one at all."""
    p = Path(path)
    if _MODEL_RE.match(p.name) and p.exists():
        return f"{p.name} has no meta_{_MODEL_RE.match(p.name).group(1)}.json beside it"
    if not p.is_dir():
        return None
    names = [f.name for f in p.iterdir()]
    models = sorted((int(m.group(1)), n) for n in names if (m := _MODEL_RE.match(n)))
    metas = sorted((int(m.group(1)), n) for n in names if (m := _META_RE.match(n)))
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
            raise InputError(f"'{spec}': no checkpoint tag {tag!r} under {root} (tags there: {', '.join(have) or 'none'})")
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
        existing = find_checkpoint(out_dir)
        if existing is not None:
            stamp = max(stamp, int(_MODEL_RE.match(existing[0].name).group(1)) + 1)
    return broadcast_object(stamp)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(out_dir: str | os.PathLike, stamp: int, model_state: dict | Callable[[Path], None], meta: dict,
                    train_state: dict | None = None) -> Path:
    """Rank 0 only. model_state is a state dict (-> model_<stamp>.pt) or a function that writes a
    directory (-> model_<stamp>/, e.g. save_pretrained). Returns the model path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    if callable(model_state):
        model_path = d / f"model_{stamp}"
        tmp_dir = d / f"model_{stamp}.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        model_state(tmp_dir)
        os.replace(tmp_dir, model_path)
    else:
        model_path = d / f"model_{stamp}.pt"
        _atomic_torch_save(model_state, model_path)
    if train_state is not None:
        _atomic_torch_save(train_state, d / f"state_{stamp}.pt")
    tmp = d / f"meta_{stamp}.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, d / f"meta_{stamp}.json")
    return model_path


def save_synced(out_dir: str | os.PathLike, params: list[torch.Tensor], write: Callable[[int], Path]) -> Path:
    """Collective save: check that every rank holds the same trainable parameters, let rank 0 pick the
    stamp and call write(stamp) -> path. Returns that path on every rank."""
    check_params_in_sync(params)
    if get_world_size() > 1:
        print0(f"ddp: trainable parameters identical on {get_world_size()} ranks")
    stamp = new_stamp(out_dir)
    return broadcast_object(write(stamp) if is_main() else None)


def check_resume_args(saved: dict, args: Any, keys: tuple[str, ...], path: Path, absent: dict | None = None) -> None:
    """A resumed run must keep the settings that decide what it computes (batch, seed, ...). `absent`:
    the value a key had in checkpoints written before it was recorded."""
    for key in keys:
        was = saved.get(key, (absent or {}).get(key))
        if was != getattr(args, key):
            raise InputError(f"--{key} is {getattr(args, key)!r} but the checkpoint was trained with "
                             f"{was!r}; resume with the same setting", path=str(path))


def resolve_resume(resume: str, out_dir: str | os.PathLike) -> tuple[Path, Path, Path]:
    """`latest` (newest complete checkpoint in out_dir) or a path -> (model, meta, state) files."""
    target = out_dir if resume == "latest" else resume
    found = find_checkpoint(target)
    if found is None:
        raise InputError("no complete checkpoint to resume from", path=str(target))
    model_path, meta_path = found
    state_path = model_path.parent / f"state_{_MODEL_RE.match(model_path.name).group(1)}.pt"
    if not state_path.is_file():
        raise InputError("checkpoint has no resume state (state_<stamp>.pt)", path=str(model_path))
    return model_path, meta_path, state_path


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
        return f"{d}: output dir cannot be written ({e.strerror or e})"
    return None
