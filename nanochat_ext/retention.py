"""--keep_last: which checkpoints a run keeps in its --out. A checkpoint of an SFT-sized model with its optimizer state
is three times the model (fp32 weights, AdamW's two moments), so a long run that saves every N steps keeps the newest
few whole and removes the rest as it goes, as TRL's save_total_limit does.

What stays: the `keep_last` newest complete checkpoints, whole (one to resume from, one to fall back on when the newest
does not load), and every final model (the step its run was asked to reach: another stage may read it), with its meta.
What goes, from older checkpoints: resume states, shards and the models of periodic saves. An older checkpoint loses
its meta first, so a crash part-way leaves files without a meta, which the next start removes (checkpoint.remove_orphans),
and never touches the checkpoints kept.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from nanochat_ext import checkpoint
from nanochat_ext.checkpoint import read_json, resumable_checkpoints

KEEP_LAST_HELP = ("keep the N newest complete checkpoints in --out and remove older resume states, shards and periodic "
                  "models once a newer checkpoint is complete; final models stay (0: keep everything) (default: "
                  "%(default)s)")


def prune(out_dir: Path, keep_last: int) -> list[str]:
    """Rank 0 only, after a checkpoint is published: remove what --keep_last does not keep (the module docstring).
    Returns the names removed, in order."""
    if keep_last == 0:
        return []
    removed = []
    for _, meta_path in resumable_checkpoints(out_dir)[keep_last:]:
        digits = meta_path.stem.removeprefix("meta_")
        meta = read_json(meta_path)
        final = meta.get("step") == meta.get("args", {}).get("max_steps")
        doomed = [f"state_{digits}.pt", f"shards_{digits}"]
        if not final:
            doomed = [meta_path.name, *doomed, f"model_{digits}.pt", f"model_{digits}"]  # the meta first
        for name in doomed:
            f = out_dir / name
            if f.is_dir():
                shutil.rmtree(f)
            elif f.exists():
                f.unlink()
            else:
                continue
            removed.append(name)
            checkpoint._SAVE_HOOK(f"removed {name}")
    return removed
