"""What the SFT, RM and GRPO trainers share around their own step: resuming, the lr schedule, when to log,
evaluate and save, a clean stop on SIGTERM or a non-finite loss, the final save and --consolidate. A trainer
says what its checkpoint holds (`Saving`) and runs its step; this module does the rest the same way for all.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn

from nanochat_ext.ddp_common import DistEnv, print0
from nanochat_ext.runtime.checkpoint import update_meta
from nanochat_ext.runtime.guard import Interrupted, StepGuard
from nanochat_ext.runtime.outdir import prune
from nanochat_ext.runtime.parallel import Parallel
from nanochat_ext.runtime.peers import PROGRESS
from nanochat_ext.runtime.resume import check_resume_args
from nanochat_ext.training.memory import doing
from nanochat_ext.training.optim import lr_multiplier
from nanochat_ext.training.tracking import Tracker

WriteWhole = Callable[[Path, int, dict, "dict | None", "dict | None"], Path]  # (dir, stamp, meta, state, weights)


@dataclass
class Saving:
    """One checkpoint as its trainer describes it: its own meta fields (kind, stamp, step, world size, metrics
    and args are added), what resuming needs beyond step, args and the optimizer, and how rank 0 writes the
    whole model in its layout (see Parallel.save)."""
    meta: dict
    write_whole: WriteWhole
    state: dict = field(default_factory=dict)


def due(done: int, every: int) -> bool:
    """Whether a `--X_every N` action is due after `done` steps (N = 0: never, only the final one)."""
    return every > 0 and done % every == 0


class Trainer:
    """The loop around a trainer's step. `saving(step, into, consolidate)` describes the checkpoint of `step`;
    `module` is the part of `model` whose layout a whole checkpoint is written in."""

    def __init__(self, args: argparse.Namespace, env: DistEnv, parallel: Parallel, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, module: nn.Module, kind: str, out_dir: Path,
                 saving: Callable[[int, Path, bool], Saving]):
        self.args, self.env, self.parallel, self.model, self.optimizer = args, env, parallel, model, optimizer
        self.module, self.kind, self.out_dir, self.saving = module, kind, out_dir, saving
        PROGRESS.out_dir, PROGRESS.max_steps = out_dir, args.max_steps
        # this run's --lr per group: a resumed optimizer state carries the saved run's (--resume_extend may differ)
        self.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        self.start_step = 0
        self.metrics: dict = {}  # the latest logged and evaluated metrics, recorded in each checkpoint's meta
        self.final: Path | None = None  # the final checkpoint, once written
        self.tracker: Tracker | None = None
        self.guard: StepGuard | None = None
        self.t_log = time.time()
        # seconds in training so far, evaluations left out (perf/train_time_s): counted up to t_count at every log,
        # save and evaluation, whatever --log_every is
        self.train_time, self.t_count = 0.0, time.time()

    def resume(self, resume: tuple | None, keys: tuple[str, ...], load_whole: Callable[[dict], None],
               absent: dict | None = None) -> int:
        """Collective: continue from `resume` (resolve_resume's choice; None: from scratch) if this run's `keys`
        flags (and schedule) are the ones it was trained with (`absent`: a key's value before it was recorded).
        Shards load into the model and optimizer; a whole checkpoint's weights through load_whole(state).
        Returns the step to continue from."""
        if resume is None:
            return 0
        path, _, state = resume
        check_resume_args(state["args"], self.args, keys, path, absent)
        if not self.parallel.resume(path, self.model, self.optimizer):
            load_whole(state)
            self.optimizer.load_state_dict(state["optimizer"])
        self.start_step = int(state["step"])
        self.train_time = float(state.get("train_time_s", 0.0))
        print0(f"resume: from {path} at step {self.start_step}" + (f" (draw {state['draw']})" if "draw" in state else ""))
        return self.start_step

    def save(self, step: int, into: Path | None = None, consolidate: bool = False, metrics: dict | None = None) -> Path:
        """Collective: the checkpoint of `step` into `into` (default: --out); its path on every rank."""
        into = self.out_dir if into is None else into
        metrics = self.metrics if metrics is None else metrics
        saving = self.saving(step, into, consolidate)
        args, world = vars(self.args), self.env.world_size
        with doing(f"the checkpoint of step {step}"):
            path = self.parallel.save(
                into, self.model, self.optimizer, module=self.module, final=step == self.args.max_steps,
                consolidate=consolidate, write_whole=saving.write_whole,
                state={"step": step, "args": args, "train_time_s": self.count_train_time(), **saving.state},
                meta=lambda stamp: {"kind": self.kind, "stamp": stamp, "step": step, **saving.meta, "world_size": world,
                                    "metrics": metrics, "args": args})
        if into == self.out_dir and self.env.is_main and (removed := prune(into, self.args.keep_last, self.kind)):
            print(f"keep_last: removed {', '.join(removed)} (older than the {self.args.keep_last} newest checkpoints)",
                  flush=True)
        return path

    def consolidate(self, resume: tuple | None) -> Path:
        """--consolidate DIR: the checkpoint resumed from, written whole into DIR."""
        return self.parallel.consolidate(self.args.consolidate, resume, self.out_dir,
                                         lambda d, metrics: self.save(self.start_step, d, True, metrics))

    def start(self, log_dir: Path, name: str) -> None:
        """Open the logs (rank 0) and arm the stop guard: the loop begins."""
        a = self.args
        self.tracker = Tracker(log_dir, self.env.is_main, a.max_steps, self.start_step, name, a.report_to, vars(a),
                               a.wandb_project)
        self.guard = StepGuard(a.skip_nonfinite)
        self.t_log = self.t_count = time.time()
        PROGRESS.done = self.start_step

    def set_lr(self, step: int) -> float:
        """The schedule's lr for `step` in every group; returns the first group's."""
        mult = lr_multiplier(step, self.args.max_steps, self.args.warmup_steps,
                             decay=getattr(self.args, "lr_decay", "cosine"))
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * mult
        return self.optimizer.param_groups[0]["lr"]

    def log_due(self, done: int) -> bool:
        return due(done, self.args.log_every) or done == self.args.max_steps

    def count_train_time(self) -> float:
        """The training seconds so far, counted up to now."""
        now = time.time()
        self.train_time += now - self.t_count
        self.t_count = now
        return self.train_time

    def elapsed(self) -> float:
        """Wall-clock seconds of this log window (evaluation left out)."""
        return time.time() - self.t_log

    def log(self, done: int, metrics: dict) -> None:
        """The window's metrics, logged with the training time so far (a learning curve's x against wall-clock);
        the next window starts now."""
        metrics = {**metrics, "perf/train_time_s": self.count_train_time()}
        self.tracker.log(done, metrics)
        self.metrics = metrics
        self.t_log = time.time()

    def eval_due(self, done: int) -> bool:
        return done == self.args.max_steps or due(done, self.args.eval_every)

    @contextlib.contextmanager
    def evaluating(self, done: int, what: str, hints: tuple[str, ...]) -> Iterator[None]:
        """Collective: the evaluation after step `done` runs inside, named for the out-of-memory line (memory.doing).
        After the last step the final checkpoint is written first (running out of memory in the final evaluation
        must not lose it, and the line says it is saved); finish() then records the evaluation's metrics in its meta."""
        last = done == self.args.max_steps
        self.count_train_time()  # the evaluation's own seconds are not (evaluated() restarts the count)
        if last and self.final is None:
            self.final = self.save(done)
        with doing(what, hints, saved=last):
            yield

    def evaluated(self, done: int, metrics: dict) -> None:
        """An evaluation's metrics (none: nothing held out), logged; its time is left out of the log window."""
        if metrics:
            self.tracker.log(done, metrics)
            self.metrics.update(metrics)
        self.t_log = self.t_count = time.time()

    def end_step(self, done: int) -> None:
        """After step `done`: stop with a checkpoint if the guard says so, or save if --save_every is due."""
        if done != self.args.max_steps:
            if self.guard.stop:
                self.tracker.close()
                raise Interrupted(done, self.save(done))
            if due(done, self.args.save_every):
                print0(f"checkpoint: {self.save(done)}")
        PROGRESS.done = done  # a save is still part of its step for the line naming a lost rank

    def finish(self) -> Path:
        """The loop is over: close the logs and write the final checkpoint (or, written before the final
        evaluation, record the metrics in its meta)."""
        self.tracker.close()
        if self.final is None:
            return self.save(self.args.max_steps)
        if self.env.is_main:
            update_meta(self.final, {"metrics": self.metrics})
        return self.final
