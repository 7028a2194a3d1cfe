"""Resuming a run: which checkpoint --resume names (the newest that loads whole, chosen by rank 0 for
every rank), and whether this run's flags fit the one it resumes.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from nanochat_ext.config import TrainerSpec
from nanochat_ext.ddp_common import agent_store, broadcast_object, is_main, print0, raise_if_any, restart_attempt
from nanochat_ext.errors import InputError
from nanochat_ext.runtime.checkpoint import (
    check_zip,
    first_loadable,
    is_shards,
    missing_shards,
    read_json,
    resumable_checkpoints,
    stamp_digits,
    torch_load,
)

SCHEDULE_KEYS = ("max_steps", "lr", "warmup_steps", "lr_decay")  # may change on resume with --resume_extend only
BEFORE_SCHEDULE_FLAGS = {"lr_decay": "cosine"}  # what a checkpoint written before such a flag existed ran with


def check_resume_args(saved: dict, flags: dict, keys: tuple[str, ...], path: Path, absent: dict | None = None) -> None:
    """A resumed run must keep the settings that decide what it computes (batch, seed, ...), and its learning-rate
    schedule unless flags['resume_extend']. `flags`: this run's, as its checkpoints record them; `absent`: the value a
    key had in checkpoints written before it was recorded."""
    extend = flags.get("resume_extend", False)
    absent = {**BEFORE_SCHEDULE_FLAGS, **(absent or {})}
    for key in keys + (() if extend else SCHEDULE_KEYS):
        if key in BEFORE_SCHEDULE_FLAGS and key not in flags:  # a flag this script lacks (SFT, RM: cosine)
            continue
        was = saved.get(key, absent.get(key))
        if was != flags[key]:
            hint = " or add --resume_extend" if key in SCHEDULE_KEYS else ""
            raise InputError(f"--{key} is {flags[key]!r} but the checkpoint was trained with "
                             f"{was!r}; resume with the same setting{hint}, or train anew beside it with another "
                             f"--tag or --out", path=str(path))


def check_kind(meta: dict, trainer: TrainerSpec, meta_path: Path, in_out: bool, writers: Mapping[str, str]) -> None:
    """The checkpoint to resume was written by this trainer (its kind): one line naming the one that wrote it (writers:
    kind -> the trainer, algorithms/trainers.py's) and what to do otherwise (another trainer's flags and state mean
    nothing here). in_out: it was found in --out."""
    wrote = meta.get("kind")
    if wrote is None or wrote == trainer.kind:
        return
    them, us = writers.get(wrote, f"another trainer (kind {wrote!r})"), trainer.script
    todo = (f"give {us} an --out of its own (or an empty one)" if in_out else
            f"give --resume a checkpoint {us} wrote")
    raise InputError(f"this checkpoint was written by {them}, not by {us}, and cannot be resumed here: {todo}",
                     path=str(meta_path))


LATEST = ("latest", "auto")  # --resume values that read --out and start fresh when it has no checkpoint
READS_OUT = (*LATEST, "must")
NEWEST_AT_START = "nanochat_ext/newest_checkpoint_at_start"  # in torchrun's store (saved_by_this_job)
RESUME_HELP = ("'latest' (or 'auto'): the newest complete checkpoint in --out, or a fresh start (said in the log) "
               "when there is none yet; 'must': the same, but no checkpoint is an error; or a checkpoint path. A "
               "resumed run continues exactly. A group torchrun restarts (--max-restarts) resumes from the newest "
               "checkpoint its job wrote in --out whatever this says, or as this says when the job wrote none")


def resolve_resume(resume: str | None, out_dir: str | os.PathLike, trainer: TrainerSpec,
                   writers: Mapping[str, str]) -> tuple[Path, Path, dict] | None:
    """Collective: --resume -> (model file or shards dir, meta file, loaded train state), or None to start from
    scratch. Rank 0 chooses, and every rank takes its choice (ranks that saw a shared dir differently would otherwise
    resume different steps); a checkpoint that does not load whole (its meta included) is skipped for an older one,
    with a warning. One written by another trainer (the meta's kind; `writers` name them) is refused in one line, and
    so is a run without --resume in an --out that holds an unfinished one of its own (refuse_unfinished)."""
    choice, error = None, None
    if is_main():
        try:
            if (saved := saved_by_this_job(out_dir)) and resume not in READS_OUT:
                print0(f"resume: torchrun restart {restart_attempt()}: from what this job saved in {out_dir}")
                choice = _choose_resume("latest", out_dir, saved)
            elif resume is not None:
                choice = _choose_resume(resume, out_dir if resume in READS_OUT else resume)
            else:
                refuse_unfinished(out_dir, trainer.kind)
            if choice is not None:
                check_kind(choice[4], trainer, choice[1], choice[1].parent == Path(out_dir), writers)
        except InputError as e:
            error = str(e)
    raise_if_any(error)
    paths = broadcast_object(choice[:3] if choice else None)  # the paths only: rank 0 keeps the state it loaded
    if paths is None:
        return None
    model_path, meta_path, state_path = paths
    return model_path, meta_path, choice[3] if is_main() else torch_load(state_path, "resume state")


def refuse_unfinished(out_dir: str | os.PathLike, kind: str) -> None:
    """A run started without --resume in an --out whose newest checkpoint of this trainer is not its run's last step:
    one line naming that step and the two ways on, rather than training from step 1 beside it (whose --keep_last
    would prune the checkpoint a resume needs, and whose logs would overlap the first run's)."""
    for _, meta_path in resumable_checkpoints(out_dir):
        try:
            meta = read_json(meta_path)
        except InputError:
            continue
        if not isinstance(meta, dict) or meta.get("kind") != kind:
            continue
        step, last = meta.get("step"), (meta.get("args") or {}).get("max_steps")
        if step != last:
            raise InputError(f"--out holds an unfinished run (its newest checkpoint is at step {step} of {last}): "
                             f"add --resume latest to go on from it, or give another --out (or empty this one) to "
                             f"start afresh", path=str(out_dir))
        return


def saved_by_this_job(out_dir: str | os.PathLike) -> list[tuple[Path, Path]]:
    """Rank 0, under torchrun: out_dir's resumable checkpoints newer than the newest that was there when this job's
    first start got here (kept in torchrun's store, which outlives restarts), newest first; [] elsewhere. A restart
    resumes from these, never from an older run that shares the dir (where torchrun keeps no store for its workers,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a restart takes every checkpoint there as its job's)."""
    found = resumable_checkpoints(out_dir)
    try:
        agent = agent_store()
        if agent is None:
            return found if restart_attempt() > 0 else []
        if not agent.check([NEWEST_AT_START]):
            agent.set(NEWEST_AT_START, stamp_digits(found[0][1]) if found else "-1")
        since = int(agent.get(NEWEST_AT_START))
    except dist.DistError:  # the store does not answer: resume as --resume says
        return []
    return [c for c in found if int(stamp_digits(c[1])) > since]


def _choose_resume(resume: str, target: str | os.PathLike, found: list[tuple[Path, Path]] | None = None
                   ) -> tuple[Path, Path, Path, dict, dict] | None:
    """Rank 0's part of resolve_resume: the newest resumable checkpoint (of target, or of `found`) that loads whole,
    with its state and its meta."""
    found = resumable_checkpoints(target) if found is None else found
    if not found:
        if resume in LATEST:
            print0(f"resume: no complete checkpoint in {target} yet; starting from scratch")
            return None
        raise InputError("no complete checkpoint to resume from", path=str(target))

    def load(model_path: Path, meta_path: Path) -> tuple[Path, Path, Path, dict, dict]:
        digits = stamp_digits(meta_path)
        meta = read_json(meta_path)  # a corrupt one falls back to the previous checkpoint, as a truncated model does
        if not isinstance(meta, dict):
            raise InputError(f"meta is {type(meta).__name__}, not a JSON object", path=str(meta_path))
        state_path = model_path.parent / f"state_{digits}.pt"
        shards = model_path.parent / f"shards_{digits}"
        if shards.is_dir():  # an fsdp run's final checkpoint, named by its model: its shards hold the optimizer
            model_path = shards
        if not state_path.is_file():
            raise InputError("checkpoint has no resume state (state_<stamp>.pt)", path=str(model_path))
        if model_path.is_file():  # a truncated model falls back to the previous checkpoint; the caller loads it
            check_zip(model_path)
        if is_shards(model_path) and (why := missing_shards(model_path)):
            raise InputError(f"sharded checkpoint is not whole: {why}", path=str(model_path))
        state = torch_load(state_path, "resume state")
        if not is_shards(model_path) and "optimizer" not in state:
            raise InputError(f"checkpoint's resume state holds no optimizer state and its shards_{digits}/ "
                             f"(which did) is gone", path=str(model_path))
        return model_path, meta_path, state_path, state, meta

    return first_loadable(target, load, found)


def started_lr(optim, lr_given: bool, resume: tuple[Path, Path, dict] | None):
    """The optimizer config (OptimConfig) a resumed run goes on with: where --lr was not given, the lr its checkpoint's
    train state records (the run's own), so a default changed since (the RM's by what trains, 9a5485a) does not change a
    run halfway; rank 0 says so where they differ."""
    if resume is None or lr_given:
        return optim
    started = resume[2].get("args", {}).get("lr")  # the train state's flags, which the resume checks read
    if started is None or started == optim.lr:
        return optim
    print0(f"resume: --lr not given: the run goes on at the {started:g} it started with (the default for it is now "
           f"{optim.lr:g}; give --lr to change it)")
    return dataclasses.replace(optim, lr=started)
