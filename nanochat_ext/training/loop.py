"""The loop every trainer runs, written once: the learning-rate schedule, its method's step, the guarded optimizer
step, when to log, evaluate and save, a clean stop on SIGTERM or a non-finite loss, the final save and --consolidate.
A trainer supplies its method (algorithms/: its step, the metrics of a log window, its evaluation) and its model in
training (setup.py); the loop does the rest the same way for all.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nanochat_ext.config import EVERY, NON_NEGATIVE, POSITIVE, option
from nanochat_ext.ddp_common import peak_memory_gb, print0
from nanochat_ext.errors import InputError
from nanochat_ext.runtime.checkpoint import base_dir, read_json, update_meta
from nanochat_ext.runtime.guard import Interrupted, StepGuard
from nanochat_ext.runtime.outdir import KEEP_LAST_HELP, claim_out_dir, prune
from nanochat_ext.runtime.progress import Phase
from nanochat_ext.runtime.resume import RESUME_HELP
from nanochat_ext.runtime.session import Session
from nanochat_ext.training.memory import StepMemory, report_peak
from nanochat_ext.training.optim import OptimConfig, guarded_step, lr_multiplier
from nanochat_ext.training.setup import ModelTraining
from nanochat_ext.training.tracking import Tracker, WindowSums, report_targets

DEFAULT_MAX_STEPS = 100
# --save_every where not given: a tenth of the run, so that a crash (not a SIGTERM, which saves) loses at most a tenth,
# within TRL's default of every 500 steps, and not more often than every 25 (a short run saves only at its end).
SAVE_EVERY_AT_LEAST, SAVE_EVERY_AT_MOST = 25, 500


def save_every(given: int | None, max_steps: int) -> int:
    """--save_every: as given, else a tenth of max_steps (rounded up)
    within [SAVE_EVERY_AT_LEAST, SAVE_EVERY_AT_MOST]."""
    if given is not None:
        return given
    return min(SAVE_EVERY_AT_MOST, max(SAVE_EVERY_AT_LEAST, -(-max_steps // 10)))


@dataclass(frozen=True)
class LoopConfig:
    """How long a run trains and how often it logs and evaluates."""
    max_steps: int | None = option(None, "{steps} (default: {max_steps})", check=POSITIVE, type=int)
    num_epochs: int | None = option(None, "--max_steps, where not given: train {unit} // --batch_size x E{epochs}",
                                    check=POSITIVE, type=int)
    log_every: int = option(10, "log train metrics every N steps", check=(EVERY[0], ">= 0 (0: only at the end)"),
                            type=int)
    eval_every: int = option(50, "evaluate on the held-out data every N steps, and at the end (0: only at the end)",
                             check=(EVERY[0], ">= 0 (0: only at the end)"), type=int)

    def with_steps(self, n_train: int, per_step: int, unit: str) -> LoopConfig:
        """--max_steps where it is not given: n_train // per_step x --num_epochs (nanochat's chat_rl counts its steps
        so; the lr schedule and the evaluation cadence follow), else DEFAULT_MAX_STEPS. With --num_epochs, rank 0 prints
        the line saying which. `unit`: what is counted (prompts, pairs)."""
        epochs = self.num_epochs
        if not epochs:
            return dataclasses.replace(self, max_steps=self.max_steps or DEFAULT_MAX_STEPS)
        if self.max_steps is not None:
            print0(f"max_steps: {self.max_steps} as given (--num_epochs {epochs} not used)")
            return self
        if n_train < per_step:
            raise InputError(f"--num_epochs {epochs}: {n_train} train {unit} make no step of {per_step}; give fewer "
                             f"per step (--batch_size), more {unit}, or --max_steps")
        steps = n_train // per_step * epochs
        print0(f"max_steps: {steps} = {n_train} train {unit} // {per_step} per step x {epochs} epochs")
        return dataclasses.replace(self, max_steps=steps)


@dataclass(frozen=True)
class OutputConfig:
    """Where a run writes its checkpoints and logs, how often, and the run it continues."""
    out: str | None = option(None, "checkpoint dir (default: $NANOCHAT_BASE_DIR/{stage_dir}/<tag>)")
    tag: str | None = option(None, "output tag (default: {tag})")
    save_every: int | None = option(None, "also checkpoint every N steps (default: a tenth of --max_steps, at least "
                                          f"{SAVE_EVERY_AT_LEAST} and at most {SAVE_EVERY_AT_MOST} steps, so that a "
                                          "crash loses at most that; 0: only at the end)", type=int,
                                    check=(EVERY[0], ">= 0 (0: only at the end)"))
    keep_last: int = option(2, KEEP_LAST_HELP, metavar="N", type=int,
                            check=(NON_NEGATIVE[0], ">= 0 (0: keep every checkpoint)"))
    resume: str | None = option(None, RESUME_HELP)
    resume_extend: bool = option(False, "let --resume change {schedule_flags} (the schedule is recomputed from the "
                                        "new values; without this flag a changed schedule is refused)",
                                 action="store_true")
    skip_nonfinite: int = option(0, "skip up to N steps whose loss or gradient is NaN/inf, logged (0: stop at the "
                                    "first, with nothing saved)", type=int, check=NON_NEGATIVE)
    log_dir: str | None = option(None, "TensorBoard + metrics.jsonl dir (default: <out>/logs)")
    log_line: str = option("short", "the step line printed every --log_every steps: short (the method's headline: "
                                    "loss, reward, ..., lr) or full (every metric, as metrics.jsonl has them)",
                           choices=("short", "full"))
    report_to: str = option("tensorboard", "where rank 0 sends the scalars besides <log_dir>/metrics.jsonl: "
                                           "tensorboard, wandb (requirements.txt pins it; WANDB_MODE=offline works), "
                                           "both as 'tensorboard,wandb', or none")
    wandb_project: str | None = option(None, "wandb project (default: $WANDB_PROJECT, else nanochat_ext)")
    consolidate: str | None = option(None, "with --resume: write the checkpoint resumed from (a sharded one too) "
                                           "whole, in the input's own layout, into DIR, and stop without training",
                                     metavar="DIR")

    def check(self) -> None:
        """One line for --report_to's unknown targets, or a --consolidate with nothing to write."""
        report_targets(self.report_to)
        if self.consolidate and self.resume is None:
            raise InputError("--consolidate DIR writes a checkpoint whole: give the one to write with --resume")

    def dirs(self, stage_dir: str, default_tag: str) -> tuple[Path, Path]:
        """(checkpoint dir, log dir): --out, else $NANOCHAT_BASE_DIR/<stage_dir>/<--tag or default_tag>."""
        out_dir = Path(self.out) if self.out else base_dir() / stage_dir / (self.tag or default_tag)
        return out_dir, Path(self.log_dir) if self.log_dir else out_dir / "logs"


class Method(Protocol):
    """A trainer's own part of the loop (algorithms/: sft, rm, dpo, grpo)."""
    name: str  # the run's name in its logs
    headline: tuple[str, ...]  # the metrics its short step line shows (--log_line short); the logs have every one
    window: WindowSums  # this rank's sums since the last log: `step` adds to them, the loop counts "steps"
    evaluation: Phase | None  # what the held-out evaluation runs (the out-of-memory line names it); None: there is none
    estimate: StepMemory | None  # the memory model's figures for a step, set beside the measured peak at the end

    def step(self, step: int, loop: Loop) -> None:
        """One training step: its forward and backward passes, each followed by loop.update(loss), the guarded
        optimizer step (GRPO takes --num_iterations of them); its phases named in loop.progress (the line of a failure
        in them)."""

    def metrics(self, sums: dict[str, float], elapsed: float) -> dict[str, float]:
        """A log window's metrics from its sums over every rank and its wall-clock seconds."""

    def evaluate(self, done: int, tracker: Tracker) -> dict[str, float]:
        """Collective, where `evaluation` is not None: the held-out metrics after step `done`."""

    def resume_state(self) -> dict:
        """What a checkpoint's resume state holds of this method (its draw, its micro-batch size)."""


class Loop:
    """One run's loop: `training` (ready, maybe resumed) trained by `method` for cfg.max_steps steps, checkpoints into
    out_dir (locked by claim_out_dir beforehand), logs into log_dir; `flags`: the run's, as its checkpoints record
    them."""

    def __init__(self, training: ModelTraining, cfg: LoopConfig, out: OutputConfig, optim: OptimConfig,
                 out_dir: Path, log_dir: Path, flags: dict, session: Session):
        self.training, self.cfg, self.out, self.optim = training, cfg, out, optim
        self.out_dir, self.log_dir, self.flags = out_dir, log_dir, flags
        self.env, self.progress = session.env, session.progress
        self.progress.out_dir, self.progress.max_steps = out_dir, cfg.max_steps
        self.save_every = save_every(out.save_every, cfg.max_steps)
        if out.save_every is None and self.save_every < cfg.max_steps:
            print0(f"save_every: {self.save_every} steps, and the end (not given: a tenth of --max_steps "
                   f"{cfg.max_steps}, at least {SAVE_EVERY_AT_LEAST}, at most {SAVE_EVERY_AT_MOST})")
        self.metrics: dict = {}  # the latest logged and evaluated metrics, recorded in each checkpoint's meta
        self.final: Path | None = None  # the final checkpoint, once written
        # seconds in training so far, evaluations left out (perf/train_time_s): counted up to t_count at every log,
        # save and evaluation, whatever --log_every is
        self.train_time, self.t_count, self.t_log = training.train_time, time.time(), time.time()
        self.done = training.start_step
        self.grad_norm = 0.0
        self.method: Method | None = None  # run()'s

    def run(self, method: Method) -> Path:
        """Collective: train from the step the model starts at to cfg.max_steps; the final checkpoint's path. A run
        resumed from its own final checkpoint is over: that stands (a stage re-run with --resume latest writes nothing).
        Anything else at its last step (shards, another run's checkpoint, a final still to merge) saves its final."""
        if self.finished():
            print0(f"resume: the run ended at step {self.done} (--max_steps): nothing to train")
            return self.training.resumed_from
        self.start(method)
        for step in range(self.training.start_step, self.cfg.max_steps):
            self.done = step + 1
            lr = self.set_lr(step)
            method.step(step, self)
            method.window.add(steps=1)
            self.tracker.advance()
            last = self.done == self.cfg.max_steps
            if last or due(self.done, self.cfg.log_every):
                self.log(method, lr)
            if method.evaluation is not None and (last or due(self.done, self.cfg.eval_every)):
                self.evaluate(method)
            self.end_step()
        if method.estimate is not None:
            report_peak(self.env.device, method.estimate)
        return self.finish()

    def finished(self) -> bool:
        """Whether this run resumed its own whole final checkpoint: a file in --out at --max_steps, nothing to merge."""
        path = self.training.resumed_from
        return (path is not None and self.done == self.cfg.max_steps and path.is_file() and path.parent == self.out_dir
                and not self.training.merge_lora)

    def start(self, method: Method) -> None:
        """Open the logs (rank 0) and arm the stop guard: the loop begins."""
        self.method = method
        self.tracker = Tracker(self.log_dir, self.env.is_main, self.cfg.max_steps, self.training.start_step,
                               method.name, self.out.report_to, self.flags, self.out.wandb_project)
        self.guard = StepGuard(self.out.skip_nonfinite)
        self.t_log = self.t_count = time.time()
        self.progress.done = self.training.start_step

    def set_lr(self, step: int) -> float:
        """The schedule's lr for `step` in every group; returns the first group's."""
        mult = lr_multiplier(step, self.cfg.max_steps, self.optim.warmup_steps, decay=self.optim.lr_decay)
        for group, base in zip(self.training.optimizer.param_groups, self.training.base_lrs):
            group["lr"] = base * mult
        return self.training.optimizer.param_groups[0]["lr"]

    def update(self, loss: float) -> float:
        """The guarded optimizer step after a backward whose loss is `loss`: its grad norm."""
        t = self.training
        with self.progress.doing("the optimizer step", t.state_hints):
            self.grad_norm = guarded_step(t.optimizer, t.trainable, self.optim.grad_clip, self.guard, self.done, loss)
        return self.grad_norm

    def log(self, method: Method, lr: float) -> None:
        """The window's metrics, logged with the training time so far (a learning curve's x against wall-clock); the
        next window starts now."""
        metrics = {**method.metrics(method.window.reduced(), time.time() - self.t_log), "train/lr": lr,
                   "train/grad_norm": self.grad_norm, **peak_memory_gb(self.env.device),
                   "perf/train_time_s": self.count_train_time()}
        shown = None if self.out.log_line == "full" else (*method.headline, "train/lr", "perf/train_time_s")
        self.tracker.log(self.done, metrics, shown)
        self.metrics = metrics
        self.t_log = time.time()
        method.window.zero()

    def evaluate(self, method: Method) -> None:
        """Collective: the evaluation after this step. After the last step the final checkpoint is written first
        (running out of memory in the final evaluation must not lose it, and the line says it is saved); finish()
        then records the evaluation's metrics in its meta. Its time is left out of the log window."""
        last = self.done == self.cfg.max_steps
        self.count_train_time()
        if last and self.final is None:
            self.final = self.save(self.done)
        phase = method.evaluation
        with self.progress.doing(phase.what, phase.hints, saved=last):
            metrics = method.evaluate(self.done, self.tracker)
        if metrics:
            self.tracker.log(self.done, metrics)
            self.metrics.update(metrics)
        self.t_log = self.t_count = time.time()

    def end_step(self) -> None:
        """After a step: stop with a checkpoint if the guard says so, or save if --save_every is due."""
        if self.done != self.cfg.max_steps:
            if self.guard.stop:
                self.tracker.close()
                raise Interrupted(self.done, self.save(self.done))
            if due(self.done, self.save_every):
                print0(f"checkpoint: {self.save(self.done)}")
        self.progress.done = self.done  # a save is still part of its step for the line naming a lost rank

    def finish(self) -> Path:
        """The loop is over: close the logs and write the final checkpoint (or, written before the final evaluation,
        record the metrics in its meta)."""
        self.tracker.close()
        if self.final is None:
            return self.save(self.cfg.max_steps)
        if self.env.is_main:
            update_meta(self.final, {"metrics": self.metrics})
        return self.final

    def save(self, step: int, into: Path | None = None, consolidate: bool = False,
             metrics: dict | None = None) -> Path:
        """Collective: the checkpoint of `step` into `into` (default: the run's out dir); its path on every rank."""
        into = self.out_dir if into is None else into
        metrics = self.metrics if metrics is None else metrics
        state = {"args": self.flags, "train_time_s": self.count_train_time(),
                 **(self.method.resume_state() if self.method is not None else {})}
        with self.progress.doing(f"the checkpoint of step {step}"):
            path = self.training.save(step, into, final=step == self.cfg.max_steps, consolidate=consolidate,
                                      meta={"world_size": self.env.world_size, "metrics": metrics, "args": self.flags},
                                      state=state)
        if into == self.out_dir and self.env.is_main and (removed := prune(into, self.out.keep_last,
                                                                           self.training.kind)):
            print(f"keep_last: removed {', '.join(removed)} (older than the {self.out.keep_last} newest checkpoints)",
                  flush=True)
        return path

    def consolidate(self, resume: tuple | None) -> Path:
        """--consolidate DIR: the checkpoint resumed from, written whole into DIR (claimed as an output), with the
        metrics its meta recorded; nothing is trained."""
        into = self.out.consolidate
        if resume is None:
            raise InputError(f"--consolidate: no checkpoint in {self.out_dir} to write whole")
        if Path(into).resolve() == self.out_dir.resolve():
            raise InputError("--consolidate DIR must be another dir than --out, which holds the run's checkpoints")
        claim_out_dir(into)
        return self.save(self.training.start_step, Path(into), True, read_json(resume[1]).get("metrics", {}))

    def count_train_time(self) -> float:
        """The training seconds so far, counted up to now."""
        now = time.time()
        self.train_time += now - self.t_count
        self.t_count = now
        return self.train_time


def due(done: int, every: int) -> bool:
    """Whether a `--X_every N` action is due after `done` steps (N = 0: never, only the final one)."""
    return every > 0 and done % every == 0
