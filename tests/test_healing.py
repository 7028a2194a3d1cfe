"""Runs that heal themselves: a torchrun group that loses a rank restarts (--max-restarts) and resumes from its newest
complete checkpoint by itself, to the weights of the run that was never interrupted (2 real gloo ranks, killed with
SIGKILL in a save and mid-step: tests/workers/die_at.py); --keep_last keeps the disk a run needs, and a kill while it
removes old checkpoints leaves the newest loadable."""
from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, run_script
from test_reliability import assert_same_weights, metas, rm_args

from nanochat_ext import ddp_common
from nanochat_ext.ddp_common import free_port
from nanochat_ext.errors import EXIT_LOST_RANK
from nanochat_ext.runtime.checkpoint import resumable_checkpoints, save_checkpoint
from nanochat_ext.runtime.resume import saved_by_this_job
from scripts import kat_train_rm

ENV = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}


def dying(module: str, faults: str, args: list[str], max_restarts: int | None = None) -> subprocess.CompletedProcess:
    """scripts.<module> killed as `faults` says (tests/workers/die_at.py): one process, or two ranks under torchrun
    --max-restarts."""
    launcher = [] if max_restarts is None else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                                 f"--max-restarts={max_restarts}"]
    cmd = [sys.executable, *launcher, str(REPO / "tests" / "workers" / "die_at.py"), module, faults, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ENV}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def grpo_args(assets, out, *extra) -> list[str]:
    return ["--policy", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--prompts", str(assets["pairs"]),
            "--reward_fn", "rewards_for_tests:vowel_share", "--batch_size", "4", "--group_size", "4",
            "--max_new_tokens", "8", "--lr", "1e-2", "--log_every", "1", "--device", "cpu", "--out", str(out), *extra]


# module, its args, --max_steps, --save_every, the step whose last rank is killed on the first restart (after the
# second save, which the first start was killed in)
TRAINERS = {"rm": ("kat_train_rm", rm_args, 12, 3, 8), "grpo": ("kat_train_grpo", grpo_args, 6, 2, 5)}


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_a_group_that_loses_a_rank_restarts_and_resumes_to_the_uninterrupted_result(assets, tmp_path, trainer):
    """The first start loses rank 0 while it writes its second checkpoint (between the state and the meta), the first
    restart loses rank 1 mid-step (gradients reduced, update not taken); the second restart finishes. The survivor
    names the lost rank each time; each restart resumes from the newest complete checkpoint without --resume, and the
    job ends by itself with the weights, bitwise, and the log of the run that was never interrupted."""
    module, make_args, steps, every, step_killed = TRAINERS[trainer]
    straight, healed = tmp_path / "straight", tmp_path / "healed"
    flags = ("--max_steps", str(steps), "--save_every", str(every))
    proc = run_script(f"scripts.{module}", make_args(assets, straight, *flags), nproc=2, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]

    proc = dying(module, f"0:state:2,1:step:{step_killed}", make_args(assets, healed, *flags), max_restarts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [line for line in proc.stdout.splitlines() if line.startswith("resume: ")]
    assert len(resumed) == 4 and resumed[0] == f"resume: torchrun restart 1: from what this job saved in {healed}"
    at_step = [int(line.split(" at step ")[1].split()[0]) for line in resumed[1::2]]
    assert at_step == [every, 2 * every], resumed  # the save killed left an orphan, removed; then the one redone
    assert resumed[2].startswith("resume: torchrun restart 2")
    assert "checkpoint: removed what an interrupted save left: " in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]  # the survivor's, each time
    assert len(errors) == 2, errors
    assert errors[0].startswith(f"error: rank 0 stopped answering in step {2 * every} (the checkpoint of step "
                                f"{2 * every}): its connection closed, nor to a roll call of 2 s; the newest "), errors
    assert errors[1].startswith(f"error: rank 1 stopped answering in step {step_killed} (the optimizer step): its "
                                f"connection closed"), errors
    assert_same_weights(straight, healed)
    logged = [[r["step"] for r in map(json.loads, (d / "logs" / "metrics.jsonl").read_text().splitlines())
               if "train/loss" in r] for d in (straight, healed)]
    assert logged[1] == logged[0] == list(range(1, steps + 1))  # every step once, as uninterrupted


def test_a_restart_does_not_repeat_a_run_that_would_end_the_same(assets, tmp_path):
    """A non-finite step ends the first start (exit 3, saved checkpoints as they were); torchrun restarts after any
    failure, and each restart ends at once with the same line instead of training up to it again."""
    out = tmp_path / "nan"
    proc = run_script("scripts.kat_train_rm", rm_args(assets, out, "--lr", "1e30", "--max_steps", "6"), nproc=2,
                      max_restarts=2)
    assert proc.returncode == 1 and "exitcode  : 3 " in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("data: ") == 1 and "resume: " not in proc.stdout  # the restarts loaded nothing
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3 and "non-finite loss" in errors[0], errors
    assert errors[1] == errors[2] == f"{errors[0]} (torchrun's previous start ended so; not run again)"


def test_a_restart_resumes_only_from_what_its_job_saved(tmp_path, monkeypatch):
    """A job restarted before its first save starts again as it started, not from an older run's checkpoint in the
    same --out: the newest stamp there when the job began is kept in torchrun's store (a real TCPStore here, as
    torchrun's agent holds one) and only newer checkpoints are resumed from."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(ddp_common, "_AGENT_STORE", None)
    out = tmp_path / "out"
    save_checkpoint(out, 100, {"w": torch.zeros(1)}, {"step": 2})  # an older run's
    assert saved_by_this_job(out) == []  # the first start records stamp 100
    save_checkpoint(out, 200, {"w": torch.ones(1)}, {"step": 1})  # this job's first save
    assert [meta.name for _, meta in saved_by_this_job(out)] == ["meta_200.json"]


# ---- a rank that hangs ----------------------------------------------------------------------------------------------
def test_a_rank_that_hangs_ends_the_run_in_one_line_naming_it(assets, tmp_path):
    """Rank 1 stops (SIGSTOP) in step 3 before its update: rank 0 waits --dist_timeout (10 s: on 2 loaded cores a
    shorter one could expire in a wait that is not a hang) in the step's all-reduce, then
    ends with exit code EXIT_LOST_RANK and one line naming rank 1, the step, the phase and the checkpoint to resume
    from; no traceback. Two processes launched as torchrun launches them, without its agent (which would stop the
    stopped rank only after its own 30 s)."""
    out = tmp_path / "hung"
    args = rm_args(assets, out, "--max_steps", "6", "--save_every", "2", "--dist_timeout", "10")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    cmd = [sys.executable, str(REPO / "tests" / "workers" / "die_at.py"), "kat_train_rm", "0:stop:3", *args]
    ranks = [subprocess.Popen(cmd, cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        _, err = ranks[0].communicate(timeout=120)
    finally:
        ranks[1].kill()
        ranks[1].communicate()
    assert ranks[0].returncode == EXIT_LOST_RANK, err[-3000:]
    newest = resumable_checkpoints(out)[0][0]
    assert err.strip().splitlines()[-1] == (
        f"error: rank 1 stopped answering in step 3 (the optimizer step): no answer within --dist_timeout 10 s, nor to "
        f"a roll call of 2.5 s; the newest complete checkpoint is {newest}: resume with --resume latest")
    assert "Traceback" not in err and "gloo" not in err
    assert [m["step"] for m in metas(out)] == [2]


# ---- --keep_last ----------------------------------------------------------------------------------------------------
def test_keep_last_keeps_the_newest_checkpoints_whole_and_every_final_model(assets, tmp_path, capsys):
    out = tmp_path / "kept"
    out.mkdir()
    for name in ("model_0.pt", "meta_0.json"):  # a nanochat checkpoint in the same dir: not this trainer's to remove
        shutil.copy(assets["gpt"] / name, out / name.replace("_0.", "_000500."))
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "6", "--save_every", "1")) == 0  # default: 2
    assert [m["step"] for m in metas(out) if "kind" in m] == [5, 6] and (out / "model_000500.pt").is_file()
    assert "keep_last: removed meta_" in capsys.readouterr().out
    assert len(list(out.glob("model_*.pt"))) == 3 and len(list(out.glob("state_*.pt"))) == 2
    # Extended to 9 steps: step 6 was the first run's final model, which stays (without its resume state).
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "9", "--save_every", "1", "--keep_last", "1",
                                     "--resume", "auto", "--resume_extend")) == 0
    assert [m["step"] for m in metas(out) if "kind" in m] == [6, 9]
    assert len(list(out.glob("model_*.pt"))) == 3 and len(list(out.glob("state_*.pt"))) == 1
    assert kat_train_rm.main(rm_args(assets, tmp_path / "all", "--max_steps", "4", "--save_every", "1",
                                     "--keep_last", "0")) == 0
    assert [m["step"] for m in metas(tmp_path / "all")] == [1, 2, 3, 4]


def test_a_kill_while_pruning_leaves_the_newest_checkpoint_loadable(assets, tmp_path, capsys):
    """Killed after the second file it removes of step 2's checkpoint (its meta, then its state): the newest complete
    checkpoint is intact, and the run resumed from it ends with the uninterrupted weights."""
    args = ("--max_steps", "6", "--save_every", "2", "--keep_last", "1")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert kat_train_rm.main(rm_args(assets, straight, *args)) == 0
    proc = dying("kat_train_rm", "0:removed:2", rm_args(assets, killed, *args))
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [m["step"] for m in metas(killed)] == [4] and len(list(killed.glob("model_*.pt"))) == 2  # one orphan
    capsys.readouterr()
    assert kat_train_rm.main(rm_args(assets, killed, *args, "--resume", "latest")) == 0  # in this process, as straight
    printed = capsys.readouterr().out
    assert "checkpoint: removed what an interrupted save left: model_" in printed
    assert "at step 4" in printed
    assert_same_weights(straight, killed)
    assert [m["step"] for m in metas(killed)] == [6] and len(resumable_checkpoints(killed)) == 1
