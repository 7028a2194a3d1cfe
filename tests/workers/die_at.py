"""A trainer killed as a job's process is killed (SIGKILL: no cleanup, no barrier): `die_at.py MODULE FAULTS ARGS`
runs scripts.MODULE with ARGS, and FAULTS (comma-separated ATTEMPT:WHAT:N) say which process dies when, on which
start of torchrun's worker group (ATTEMPT: 0 the first, 1 the first restart):
- `A:state:N`: rank 0, the rank that writes checkpoints, once it has written its N-th state_<stamp>.pt, before that
  checkpoint's meta (a kill in the save window);
- `A:removed:N`: rank 0, once it has removed its N-th file (checkpoint.remove_files: pruning old checkpoints with
  --keep_last, or what a crashed save left);
- `A:step:N`: the last rank, in step N after its gradients are reduced and before its update (a kill mid-step);
- `A:stop:N`: the same rank at the same point stopped (SIGSTOP: a rank that hangs).
The launcher then tears the other ranks down, as a scheduler's kill would, and restarts the group if allowed."""
import importlib
import os
import signal
import sys

from nanochat_ext.ddp_common import detect_launcher, restart_attempt
from nanochat_ext.runtime import checkpoint
from nanochat_ext.training import optim

module, faults = sys.argv[1], [f.split(":") for f in sys.argv[2].split(",")]
_, rank, _, world_size = detect_launcher()
now = {what: int(n) for attempt, what, n in faults if int(attempt) == restart_attempt()}
written: list[str] = []  # the files saved and removed, in order
real_step = optim.guarded_step


def die_at_nth_file(name: str) -> None:
    written.append(name)
    for what, prefix in (("state", "state_"), ("removed", "removed ")):
        if sum(w.startswith(prefix) for w in written) == now.get(what) and name.startswith(prefix):
            os.kill(os.getpid(), signal.SIGKILL)


def die_in_step(optimizer, params, grad_clip, guard, step, loss):
    if rank == world_size - 1 and step in (now.get("step"), now.get("stop")):
        os.kill(os.getpid(), signal.SIGKILL if step == now.get("step") else signal.SIGSTOP)
    return real_step(optimizer, params, grad_clip, guard, step, loss)


checkpoint._SAVE_HOOK = die_at_nth_file
optim.guarded_step = die_in_step  # before the script imports it
sys.exit(importlib.import_module(f"scripts.{module}").main(sys.argv[3:]))
