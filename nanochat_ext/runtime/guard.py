"""What stops a training run cleanly: a step whose loss or gradient is not finite, and SIGTERM/SIGINT.

Both are decided on every rank together, by one all-reduce per step taken after the backward and
before the optimizer step, so no rank runs ahead into a collective the others will never join:

- non-finite loss or grad norm on any rank: the step is not taken; the run stops with one line
  naming the step (errors.EXIT_NONFINITE) and nothing new is saved, so the last good checkpoint is the one
  to resume. `--skip_nonfinite N` skips up to N such steps instead (each logged).
- SIGTERM (what SLURM and Kubernetes send before a kill) or SIGINT on any rank: the step finishes,
  rank 0 writes a checkpoint, and every rank exits with errors.EXIT_INTERRUPTED and one line saying how to
  resume. A second signal a second or more after the first exits at once (a run called in the caller's process,
  nanochat_ext.api's, raises KeyboardInterrupt instead); one within the second is the same event delivered twice
  (the terminal and torchrun both pass Ctrl-C / SIGTERM on). The handlers the run replaced are put back when it ends.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import torch

from nanochat_ext.ddp_common import all_reduce_sum, detect_launcher, print0


class NonFiniteError(Exception):
    """A step's loss or gradient was not finite on some rank (more often than --skip_nonfinite allows)."""


class Interrupted(Exception):
    """SIGTERM/SIGINT: the run checkpointed at `step` (to `path`) and stops."""

    def __init__(self, step: int, path: object):
        super().__init__(f"interrupted at step {step}; checkpoint {path}; resume with --resume latest")
        self.step, self.path = step, path


_signal_at: float | None = None  # when the first SIGTERM/SIGINT arrived
signal_number: int | None = None  # which one
_replaced: dict[int, object] = {}  # the handlers install_signal_handlers replaced, put back when the run ends
in_process = False  # a run called in the caller's own process (nanochat_ext.api): a second signal raises, never exits


def _on_signal(signum: int, frame) -> None:
    global _signal_at, signal_number
    now = time.monotonic()
    if _signal_at is None:
        _signal_at, signal_number = now, signum
        if detect_launcher()[1] == 0:  # every rank gets the signal; one line says so
            print(f"signal: {signal.Signals(signum).name}; finishing this step, then checkpointing (send it again "
                  f"to stop at once)", file=sys.stderr, flush=True)
    elif now - _signal_at >= 1.0:
        print(f"error: second {signal.Signals(signum).name}: stopped at once, without a checkpoint",
              file=sys.stderr, flush=True)
        if in_process:  # a notebook's kernel, a user's script: theirs to end, not ours
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopped at once, without a checkpoint")
        os._exit(128 + signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT ask the run to stop after the current step. Only the main thread can install handlers:
    a run called from another thread installs none (a preemption is then its caller's to handle). The handlers
    replaced are put back by restore_signal_handlers, the caller's own included."""
    global _signal_at, signal_number
    _signal_at = signal_number = None
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        _replaced.setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, _on_signal)


def restore_signal_handlers() -> None:
    """The handlers there were before the run's, as they were (nothing where the run installed none)."""
    for sig, handler in list(_replaced.items()):
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    _replaced.clear()


class StepGuard:
    """One collective check per optimizer step; see the module docstring."""

    def __init__(self, skip_nonfinite: int = 0):
        """Made as the training loop starts: from then on SIGTERM/SIGINT wait for the end of a step
        (before it, and in scripts without a training loop, they stop the process as usual)."""
        self.skip_nonfinite = skip_nonfinite
        self.skipped = 0
        self.stop = False  # a signal arrived on some rank: checkpoint after this step and exit
        install_signal_handlers()

    def check(self, step: int, loss: float, grad_norm: float | torch.Tensor) -> bool:
        """Collective, after the backward and before optimizer.step(): True when the step may be
        taken. Raises NonFiniteError when it may not and no skip is left."""
        flags = all_reduce_sum(torch.tensor([not math.isfinite(loss), not math.isfinite(float(grad_norm)),
                                             _signal_at is not None], dtype=torch.float64))
        self.stop = self.stop or bool(flags[2] > 0)
        if flags[0] == 0 and flags[1] == 0:
            return True
        what = " and ".join(w for w, f in (("loss", flags[0]), ("gradient norm", flags[1])) if f > 0)
        if self.skipped < self.skip_nonfinite:
            self.skipped += 1
            print0(f"nonfinite: step {step}: non-finite {what}; step skipped "
                   f"({self.skipped} of --skip_nonfinite {self.skip_nonfinite})")
            return False
        raise NonFiniteError(f"step {step}: non-finite {what}; stopped before the optimizer step, nothing saved; "
                             f"resume from the last checkpoint with a lower --lr (or allow --skip_nonfinite N)")
