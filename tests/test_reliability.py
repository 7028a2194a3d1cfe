"""Reliability: non-finite steps, crashes in the save window, preemption signals, the out-dir lock,
disk-full saves, corrupt inputs and flag ranges each end in one line, an exit code and the files
docs/reliability.md promises; 2-rank gloo runs where ranks must agree."""
from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, assert_bitwise, assert_stopped, run_script
from forked import run_python

from nanochat_ext.algorithms.trainers import SPECS, WRITERS
from nanochat_ext.ddp_common import free_port
from nanochat_ext.errors import EXIT_INTERRUPTED, EXIT_NONFINITE, InputError
from nanochat_ext.runtime import checkpoint
from nanochat_ext.runtime.resume import resolve_resume
from nanochat_ext.tokenizer import TokenizerWrapper
from scripts import kat_eval, kat_train_grpo, kat_train_rm


def rm_args(assets, out, *extra) -> list[str]:
    return ["--backbone", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]),
            "--pairs", str(assets["pairs"]), "--batch_size", "8", "--max_len", "64", "--device", "cpu",
            "--eval_every", "0", "--log_every", "1", "--unfreeze_last", "1", "--lr", "3e-3", "--out", str(out), *extra]


def metas(out) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("meta_*.json")), key=lambda m: m["step"])


def assert_same_weights(a, b):
    """Bitwise: a resumed run repeats the uninterrupted run's computation (same kernels, shapes, order)."""
    assert_bitwise(*(torch.load(checkpoint.find_checkpoint(d)[0], weights_only=True) for d in (a, b)))


# ---- finite or stop -------------------------------------------------------------------------------
def test_a_non_finite_step_stops_both_ranks_and_saves_nothing_new(assets, tmp_path):
    out = tmp_path / "nan"
    proc = run_script("scripts.kat_train_rm", rm_args(assets, out, "--lr", "1e30", "--max_steps", "6",
                                                      "--save_every", "1"), nproc=2, torchrun=True)
    assert_stopped(proc, 3, "error: step 2: non-finite loss and gradient norm; stopped before the optimizer step", 2)
    assert [m["step"] for m in metas(out)] == [1]  # the last good checkpoint, nothing after it
    assert not list(out.glob("*.tmp"))


def test_skip_nonfinite_skips_the_bad_steps_and_saves_finite_weights(assets, tmp_path, capsys):
    out = tmp_path / "skip"
    assert kat_train_rm.main(rm_args(assets, out, "--lr", "1e30", "--max_steps", "4", "--skip_nonfinite", "5")) == 0
    printed = capsys.readouterr().out
    assert "nonfinite: step 2: non-finite loss and gradient norm; step skipped (1 of --skip_nonfinite 5)" in printed
    weights = torch.load(checkpoint.find_checkpoint(out)[0], weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert kat_train_rm.main(rm_args(assets, tmp_path / "over", "--lr", "1e30", "--max_steps", "6",
                                     "--skip_nonfinite", "2")) == EXIT_NONFINITE


def test_a_non_finite_rm_score_stops_grpo_naming_the_prompt(assets, tmp_path, capsys):
    rm = tmp_path / "rm"
    assert kat_train_rm.main(rm_args(assets, rm, "--max_steps", "1")) == 0
    model = checkpoint.find_checkpoint(rm)[0]
    state = torch.load(model, weights_only=True)
    state["head.weight"].fill_(float("nan"))
    torch.save(state, model)
    capsys.readouterr()
    rc = kat_train_grpo.main(["--policy", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--rm", str(rm),
                              "--prompts", str(assets["pairs"]), "--batch_size", "2", "--group_size", "2",
                              "--max_new_tokens", "4", "--max_steps", "1", "--device", "cpu",
                              "--out", str(tmp_path / "g")])
    assert rc == 2
    assert "the reward model scored nan on prompt" in capsys.readouterr().err


# ---- crash-safe resume ----------------------------------------------------------------------------
KILL_AT_SECOND_STATE = ("import os, sys; from nanochat_ext.runtime import checkpoint; n = []\n"
                        "def hook(name):\n"
                        "    n.append(name)\n"
                        "    if sum(x.startswith('state_') for x in n) == 2: os._exit(9)\n"
                        "checkpoint._SAVE_HOOK = hook\n"
                        "from scripts import kat_train_rm; sys.exit(kat_train_rm.main(sys.argv[1:]))")


def test_a_kill_between_state_and_meta_resumes_to_the_uninterrupted_result(assets, tmp_path, capsys):
    args = ("--max_steps", "6", "--save_every", "2")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert kat_train_rm.main(rm_args(assets, straight, *args)) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run_python(["-c", KILL_AT_SECOND_STATE, *rm_args(assets, crashed, *args)], 1, env, REPO, 300)
    assert proc.returncode == 9
    assert len(list(crashed.glob("state_*.pt"))) == 2 and len(list(crashed.glob("meta_*.json"))) == 1  # the orphan
    capsys.readouterr()
    assert kat_train_rm.main(rm_args(assets, crashed, *args, "--resume", "latest")) == 0  # in this process, as straight
    printed = capsys.readouterr().out
    assert "checkpoint: removed what an interrupted save left: model_" in printed
    assert "resume: from" in printed and "at step 2" in printed
    assert_same_weights(straight, crashed)
    records = [json.loads(line) for line in (crashed / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 7))  # the crashed run's 3-4 dropped


def test_resume_latest_without_a_checkpoint_starts_fresh_and_must_refuses(assets, tmp_path, capsys):
    out = tmp_path / "fresh"
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "1", "--resume", "latest")) == 0
    assert "no complete checkpoint in" in capsys.readouterr().out
    assert kat_train_rm.main(rm_args(assets, tmp_path / "none", "--max_steps", "1", "--resume", "must")) == 2
    assert "no complete checkpoint to resume from" in capsys.readouterr().err


def test_resume_refuses_a_changed_schedule_unless_extended(assets, tmp_path, capsys):
    out = tmp_path / "sched"
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "2")) == 0
    capsys.readouterr()
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--resume", "latest")) == 2
    assert "--max_steps is 4 but the checkpoint was trained with 2; resume with the same setting or add " \
           "--resume_extend" in capsys.readouterr().err
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--resume", "latest", "--resume_extend")) == 0
    assert metas(out)[-1]["step"] == 4


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(assets, tmp_path, capsys):
    out = tmp_path / "two_ckpts"
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--save_every", "2")) == 0
    newest = checkpoint.find_checkpoint(out)[0]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    capsys.readouterr()
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--resume", "latest")) == 0
    printed = capsys.readouterr().out
    assert "warning: skipping a checkpoint that does not load" in printed and "at step 2" in printed


def _checkpoints(out, kind: str, steps: tuple[int, ...]) -> list:
    """Tiny resumable checkpoints of a trainer `kind`, as Trainer.save writes them: model, state, meta."""
    return [checkpoint.save_checkpoint(out, 1000 + step, {"w": torch.zeros(1)}, {"kind": kind, "step": step},
                                       {"step": step, "args": {}, "optimizer": {}}) for step in steps]


def test_a_corrupt_newest_meta_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    """As docs/reliability.md says of a checkpoint that no longer loads: the previous one, with a warning (the corrupt
    meta was taken before, its state read as if whole)."""
    older, newest = _checkpoints(tmp_path, "reward_model", (2, 4))
    (tmp_path / "meta_1004.json").write_text('{"kind": "rew')  # truncated
    model, meta, state = resolve_resume("latest", tmp_path, SPECS["rm"], WRITERS)
    assert (model, meta, state["step"]) == (older, tmp_path / "meta_1002.json", 2)
    assert "warning: skipping a checkpoint that does not load (" in capsys.readouterr().out


def test_an_out_dir_of_another_trainer_says_which_wrote_it_and_what_to_do(tmp_path):
    _checkpoints(tmp_path, "reward_model", (2,))
    with pytest.raises(InputError, match=r"meta_1002.json: this checkpoint was written by kat_train_rm \(a reward "
                                         r"model\), not by kat_train_grpo, .*give kat_train_grpo an --out of its own"):
        resolve_resume("latest", tmp_path, SPECS["grpo"], WRITERS)
    with pytest.raises(InputError, match=r"written by kat_train_rm .* give --resume a checkpoint kat_sft wrote"):
        resolve_resume(str(tmp_path / "model_1002.pt"), tmp_path / "sft_out", SPECS["sft"], WRITERS)
    assert resolve_resume("latest", tmp_path, SPECS["rm"], WRITERS)[2]["step"] == 2


# ---- preemption -----------------------------------------------------------------------------------
def piped(command: list[str], log) -> tuple[subprocess.Popen, subprocess.Popen]:
    """`COMMAND 2>&1 | tee LOG`, how most people keep a log: the command in a session of its own (a terminal's job,
    which the signal reaches), tee's stdout read by the test."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tee = subprocess.Popen(["tee", str(log)], stdin=proc.stdout, stdout=subprocess.PIPE, text=True)
    proc.stdout.close()  # tee holds the pipe's only reader
    return proc, tee


def stop_with_the_reader_gone(proc, tee, after: str, sig: int) -> None:
    """Once a line starting with `after` passed through tee: tee killed (the same Ctrl-C ends it), then `sig` to the
    command's process group, whose next writes (the signal's own line first) meet a pipe with no reader."""
    for line in tee.stdout:
        if line.startswith(after):
            break
    tee.kill()
    tee.wait()
    os.killpg(proc.pid, sig)
    proc.wait(timeout=120)


def test_ctrl_c_on_two_ranks_with_the_pipe_gone_checkpoints_and_resumes_exactly(assets, tmp_path):
    """Ctrl-C through `torchrun ... 2>&1 | tee log` (the terminal's SIGINT ends tee too; torchrun passes it on to the
    ranks): the ranks finish the step, checkpoint and exit, their lines kept in logs/console.log, and the resumed run
    ends with the uninterrupted run's weights. 20 steps: the signal comes at step 3, and steps take about 0.25 s
    here. (SIGTERM, what SLURM sends, takes the same path: the one-process test below.)"""
    sig = signal.SIGINT
    args = ("--max_steps", "20")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_script("scripts.kat_train_rm", rm_args(assets, straight, *args), nproc=2).returncode == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "scripts.kat_train_rm", "--", *rm_args(assets, stopped, *args)]
    proc, tee = piped(cmd, tmp_path / "tee.log")
    stop_with_the_reader_gone(proc, tee, "rm step 3 ", sig)
    # torchrun's agent, signalled too, ends as it does: 1 after its SignalException's traceback, or an abort while it
    # shuts down (seen: -6); no rank is left running
    assert proc.returncode != 0
    assert subprocess.run(["pgrep", "-f", str(stopped)], capture_output=True).stdout == b""
    log = (stopped / "logs" / "console.log").read_text()
    assert not [x for x in log.splitlines() if x.startswith("error: ")], log[-2000:]
    (line,) = [x for x in log.splitlines() if x.startswith("interrupted at step ")]  # rank 0's, once
    step = int(line.split()[3].rstrip(";"))
    assert 3 <= step < 20 and "resume with --resume latest" in line
    assert f"signal: {signal.Signals(sig).name}; finishing this step" in log
    assert [m["step"] for m in metas(stopped)] == [step] and not list(stopped.glob("*.tmp"))
    resumed = run_script("scripts.kat_train_rm", rm_args(assets, stopped, *args, "--resume", "latest"), nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_weights(straight, stopped)
    lines = (stopped / "logs" / "console.log").read_text().splitlines()  # the resumed run's appended, headed by its
    heads = [x for x in lines if x.startswith("== ")]                     # command
    assert len(heads) == 2 and heads[1].endswith("--resume latest") and lines[-1].startswith("checkpoint: "), lines[-5:]


@pytest.mark.parametrize("sig,pipe", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_signal_on_one_process_exits_with_the_interrupted_code(assets, tmp_path, sig, pipe):
    """SIGTERM (SLURM's, Kubernetes'), and Ctrl-C through `| tee` with the reader gone before the signal's line: the
    step finishes, the checkpoint is written, the run exits 75 with the line saying how to resume (in console.log
    where no pipe is left)."""
    out = tmp_path / "int"
    cmd = [sys.executable, "-m", "scripts.kat_train_rm", *rm_args(assets, out, "--max_steps", "60")]
    if pipe:
        proc, tee = piped(cmd, tmp_path / "tee.log")
        stop_with_the_reader_gone(proc, tee, "rm step 2 ", sig)
        err = (out / "logs" / "console.log").read_text()
    else:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("rm step 2 "):
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted at step ")
    # #80 item 7: the same command again without --resume is refused, naming the step; the checkpoint stays whole
    saved = sorted(p.name for p in out.iterdir())
    step = metas(out)[0]["step"]
    again = run_script("scripts.kat_train_rm", rm_args(assets, out, "--max_steps", "60"))
    assert again.returncode == 2 and f"unfinished run (its newest checkpoint is at step {step} of 60): add --resume " \
        f"latest" in again.stderr.strip().splitlines()[-1], again.stderr[-1000:]
    assert sorted(p.name for p in out.iterdir()) == saved


SIGNAL_TWICE = ("import os, signal, sys, time; from nanochat_ext.runtime import guard; "
                "guard.install_signal_handlers()\n"
                "os.kill(os.getpid(), signal.SIGINT); time.sleep(float(sys.argv[1])); "
                "os.kill(os.getpid(), signal.SIGINT)\n"
                "time.sleep(0.2); print('still running', flush=True)")


@pytest.mark.parametrize("gap,code", [(1.2, 128 + signal.SIGINT), (0.0, 0)])
def test_a_second_signal_stops_at_once_unless_it_is_the_same_event(gap, code):
    """A Ctrl-C reaches a worker twice within milliseconds (from the terminal and from torchrun): one event."""
    proc = subprocess.run([sys.executable, "-c", SIGNAL_TWICE, str(gap)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert ("error: second SIGINT: stopped at once, without a checkpoint" in proc.stderr) == (code != 0)
    assert ("still running" in proc.stdout) == (code == 0)


# ---- one run per --out ----------------------------------------------------------------------------
def test_a_second_run_on_a_locked_out_dir_stops_naming_the_holder(assets, tmp_path, capsys):
    out = tmp_path / "locked"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from nanochat_ext.runtime import outdir; "
                               "outdir._lock(__import__('pathlib').Path(sys.argv[1])); print('held', flush=True); "
                               "sys.stdin.read()", str(out)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "1")) == 2
        err = capsys.readouterr().err
        assert f"another run is using this output dir (lock held by pid {holder.pid} on " in err
        assert not list(out.glob("model_*"))
    finally:
        holder.communicate("", timeout=30)  # the holder exits: the OS releases its lock
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "1")) == 0


# ---- disk full ------------------------------------------------------------------------------------
def test_a_full_disk_at_save_removes_the_partial_files_and_keeps_the_previous_checkpoint(assets, tmp_path, capsys,
                                                                                       monkeypatch):
    out = tmp_path / "full"
    real_save, calls = torch.save, []

    def save_until_full(obj, path, *a, **k):  # the second checkpoint's model file runs out of space mid-write
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_full)
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--save_every", "2")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(No space left on device); " in err and " MiB free there" in err
    assert [m["step"] for m in metas(out)] == [2]
    names = {p.name for p in out.iterdir()} - {"logs", ".lock", "tokenizer.pkl"}
    assert len(names) == 3 and not any(n.endswith(".tmp") for n in names), names  # model, state, meta of step 2


def test_a_full_disk_in_a_sharded_save_removes_its_shards_and_keeps_the_previous_checkpoint(assets, tmp_path, capsys,
                                                                                            monkeypatch):
    """--parallel fsdp (one rank, in this process): the step-4 shards run out of space mid-write. One line, and
    the step-2 sharded checkpoint stays the newest; --resume latest continues from it."""
    from nanochat_ext.runtime import parallel
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the one-rank group this process makes, scoped to this test
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out, real_save, calls = tmp_path / "full", parallel.Parallel.save_shards, []

    def save_until_full(self, path, model, optimizer):
        calls.append(path)
        if len(calls) == 2:
            path.mkdir(parents=True)
            (path / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(self, path, model, optimizer)

    monkeypatch.setattr(parallel.Parallel, "save_shards", save_until_full)
    args = rm_args(assets, out, "--max_steps", "6", "--save_every", "2", "--parallel", "fsdp")
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "could not write sharded checkpoint" in err and " MiB free there" in err
    assert "(No space left on device)" in err
    assert [m["step"] for m in metas(out)] == [2]
    assert sorted(p.name.split("_")[0] for p in out.iterdir() if p.name[0] != ".") == ["logs", "meta", "shards",
                                                                                       "state"]  # step 2's only
    monkeypatch.setattr(parallel.Parallel, "save_shards", real_save)
    assert kat_train_rm.main([*args, "--resume", "latest"]) == 0
    assert "at step 2" in capsys.readouterr().out
    assert [m["step"] for m in metas(out)] == [4, 6] and len(list(out.glob("shards_*"))) == 2  # --keep_last 2


def test_out_of_memory_in_a_step_on_two_ranks_is_one_line_on_each_and_resumes(assets, tmp_path):
    """Out of memory in the third step's first micro-batch, on both ranks: each ends with exit code 4 and the one line
    (the phase, what was allocating, the flags that take less memory there), which the two share and so say once;
    steps 1-2 stay saved and --resume latest finishes the run."""
    out = tmp_path / "oom"
    args = rm_args(assets, out, "--max_steps", "4", "--save_every", "1", "--device_batch_size", "2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "workers" / "oom_at_step.py"), "kat_train_rm", "5", *args]  # 2 micro-batches a step
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert_stopped(proc, 4, "error: out of memory in a training micro-batch", 2)
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert line == (
        "error: out of memory in a training micro-batch of 2 pairs (Tried to allocate 2.50 GiB); to take less: "
        "--device_batch_size 1, --activation_checkpointing, --parallel fsdp (weights, gradients and optimizer state "
        "sharded over the GPUs), --lora_r 16 --unfreeze_last 0 (LoRA: gradients and optimizer state for the adapters "
        "only); nothing was saved for this step: resume from the last checkpoint with --resume latest")
    assert "OutOfMemoryError" not in proc.stderr  # no worker printed a traceback (torchrun prints its own)
    assert [m["step"] for m in metas(out)] == [1, 2] and not list(out.glob("*.tmp"))
    resumed = run_script("scripts.kat_train_rm", [*args, "--resume", "latest"], nproc=2)
    assert resumed.returncode == 0 and "at step 2" in resumed.stdout, resumed.stderr
    assert [m["step"] for m in metas(out)] == [3, 4]  # --keep_last 2


# ---- bad input: one line each ---------------------------------------------------------------------
@pytest.mark.parametrize("extra,expected", [
    (["--max_steps", "0"], "--max_steps must be >= 1, got 0"),
    (["--max_steps", "-3"], "--max_steps must be >= 1, got -3"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--max_len", "2"], "--max_len must be >= 3"),
    (["--save_every", "-1"], "--save_every must be >= 0"),
    (["--keep_last", "-1"], "--keep_last must be >= 0 (0: keep every checkpoint), got -1"),
    (["--log_every", "-1"], "--log_every must be >= 0"),
    (["--weight_cap", "0"], "--weight_cap must be > 0"),
    (["--dist_timeout", "0"], "--dist_timeout must be a finite number of seconds > 0, got 0.0"),
    (["--unfreeze_last", "x"], "--unfreeze_last must be a number of blocks or 'all'"),
    (["--batch_size", "8", "--device_batch_size", "3"], "is 8 per rank, which --device_batch_size 3 does not divide"),
    (["--lora_r", "-1"], "--lora_r must be >= 0 (0: no LoRA, a full fine-tune), got -1"),
    (["--lora_r", "4", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1), got 1.0"),
    (["--merge_lora"], "--merge_lora is for LoRA: give --lora_r too"),
    (["--lora_r", "4", "--unfreeze_last", "1"], "--unfreeze_last trains whole blocks and --lora_r adapters"),
    (["--lora_r", "4", "--unfreeze_last", "0", "--lora_targets", "c_q,nope"],
     "--lora_targets: no module named 'nope' in this GPT (its linear layers: c_fc,c_k,c_proj,c_q,c_v,lm_head)"),
])
def test_flags_out_of_range(assets, tmp_path, capsys, extra, expected):
    assert kat_train_rm.main(rm_args(assets, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --") and expected in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra,expected", [
    (["--temperature", "-1"], "--temperature must be > 0"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--reward_clip", "0"], "--reward_clip must be a finite number > 0"),
    (["--num_epochs", "0"], "--num_epochs must be >= 1"),
    (["--parallel", "fsdp", "--optimizer", "muon"], "--optimizer muon orthogonalises whole matrices"),
    (["--consolidate", "somewhere"],
     "--consolidate DIR writes a checkpoint whole: give the one to write with --resume"),
    (["--lora_r", "8", "--parallel", "fsdp"], "train LoRA with --parallel ddp"),
    (["--lora_r", "8", "--optimizer", "muon"], "LoRA's adapters train with --optimizer adamw"),
])
def test_grpo_flags_out_of_range(assets, tmp_path, capsys, monkeypatch, extra, expected):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # --parallel fsdp makes a one-rank group in this process
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    args = ["--policy", str(assets["gpt"]), "--prompts", str(assets["pairs"]), "--reward_fn",
            "rewards_for_tests:vowel_share", "--device", "cpu", "--out", str(tmp_path / "out"), *extra]
    assert kat_train_grpo.main(args) == 2
    assert expected in capsys.readouterr().err


def test_log_every_zero_logs_only_the_last_step(assets, tmp_path):
    out = tmp_path / "quiet"
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "3", "--log_every", "0")) == 0
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [3]


def _corrupt_copy(assets, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(assets["gpt"], d)
    return d


@pytest.mark.parametrize("case,expected", [
    ("tool_prompts_missing", "absent.jsonl: --tool_prompts: file not found"),  # before: dropped, exit 0
    ("prompt_too_long", "prompts.jsonl:2: field 'prompt': prompt of "),  # before: a traceback
    ("pass_k_without_references", "prompts.jsonl:1: field 'answer': has no '#### <number>' line"),  # before: 1.000
])
def test_kat_eval_checks_its_inputs_before_any_work(assets, tmp_path, capsys, case, expected):
    prompts = tmp_path / "prompts.jsonl"
    long = "tell me more " * (200 if case == "prompt_too_long" else 1)
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?", "answer": "4"}) + "\n" +
                       json.dumps({"prompt": long, "answer": "5"}) + "\n")
    extra = {"tool_prompts_missing": ["--tool_prompts", str(tmp_path / "absent.jsonl")],
             "pass_k_without_references": ["--pass_k", "2"]}.get(case, [])  # the task reward: gsm8k by default
    rc = kat_eval.main(["--base_dir", str(tmp_path), "--rm", "--policy_before", str(assets["gpt"]), "--eval_prompts",
                        str(prompts), "--samples", "1", "--max_new_tokens", "4", "--out", str(tmp_path / "report.md"),
                        "--device", "cpu", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "report.md").exists()


def test_kat_eval_measures_the_demos_default_tool_prompts_only_with_their_reward(assets, tmp_path, capsys):
    """The demo's tool prompts (answers as plain numbers, found by default) are not refused for want of gsm8k's
    '#### ' line when no --reward_fn was given: tool use is left out, in one line; the report is written."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "eval_arithmetic.jsonl").write_text(json.dumps({"prompt": "What is 2 plus 2?", "answer": "4"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    rc = kat_eval.main(["--base_dir", str(tmp_path), "--rm", "--policy_before", str(assets["gpt"]), "--eval_prompts",
                        str(prompts), "--samples", "1", "--max_new_tokens", "2", "--out", str(tmp_path / "report.md"),
                        "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and (tmp_path / "report.md").exists()
    assert "kat_eval: tool use not measured: " in out and "nanochat_ext.tasks.synthetic:task_reward" in out


@pytest.mark.parametrize("case", ["truncated_model", "meta_not_json", "tokenizer_garbage", "pairs_utf16",
                                  "pairs_binary", "log_dir_unwritable"])
def test_corrupt_inputs_end_in_one_line(assets, tmp_path, capsys, case):
    backbone, tokenizer, pairs, extra = _corrupt_copy(assets, tmp_path, "bb"), assets["tokenizer"], assets["pairs"], []
    model = checkpoint.find_checkpoint(backbone)[0]
    if case == "truncated_model":
        model.write_bytes(model.read_bytes()[:1000])
        expected = f"{model}: cannot read the checkpoint"
    elif case == "meta_not_json":
        model.with_name(model.name.replace("model_", "meta_").replace(".pt", ".json")).write_text('{"model_config": ')
        expected = "meta is not valid JSON"
    elif case == "tokenizer_garbage":
        tokenizer = tmp_path / "tok"
        tokenizer.mkdir()
        # Fixed garbage: random bytes differ per run, and some unpickle into objects that fail outside the load (a
        # SystemError printed at exit, seen once in ~600 runs).
        (tokenizer / "tokenizer.pkl").write_bytes(random.Random(0).randbytes(64))
        expected = f"{tokenizer / 'tokenizer.pkl'}: cannot read the tokenizer"
    elif case == "pairs_utf16":
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text(assets["pairs"].read_text(), encoding="utf-16")
        expected = f"{pairs}:1: not UTF-8 (byte 0xff at column 1)"
    elif case == "pairs_binary":
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_bytes(assets["pairs"].read_bytes().splitlines(keepends=True)[0] + b"\x80\x81\xfe\n")
        expected = f"{pairs}:2: not UTF-8 (byte 0x80 at column 1)"
    else:
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        extra = ["--log_dir", str(blocker / "logs")]
        expected = "a_file/logs: dir cannot be written"
    args = rm_args(assets, tmp_path / "out", "--max_steps", "1", *extra)
    args[1], args[3], args[5] = str(backbone), str(tokenizer), str(pairs)
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err


def _broken_hf(assets, tmp_path, case: str):
    """The tiny Hugging Face Llama dir broken the way downloads and mix-ups break it; (dir, what the line says)."""
    d = tmp_path / case
    shutil.copytree(assets["hf"], d)
    weights, config = d / "model.safetensors", d / "config.json"
    if case == "weights_truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
        return d, "Hugging Face model does not load (SafetensorError"
    if case == "weights_missing":
        weights.unlink()
        return d, "Hugging Face model does not load (OSError: Error no file named model.safetensors"
    if case == "weights_are_text":
        weights.write_text("not weights\n")
        return d, "Hugging Face model does not load (SafetensorError"
    if case == "config_not_json":
        config.write_text('{"model_type": ')
        return d, "config.json: config is not valid JSON"
    if case == "config_does_not_fit":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 32}))
        return d, "Hugging Face model does not load (RuntimeError"
    if case == "tokenizer_broken":
        (d / "tokenizer.json").write_text("{broken")
        return d, "Hugging Face tokenizer does not load (JSONDecodeError"
    assert case == "a_classifier", case
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": ["LlamaForSequenceClassification"],
                                  "num_labels": 1}))
    return d, "a reward model (a sequence classifier), not a causal LM: give it as --rm"


@pytest.mark.parametrize("case", ["weights_truncated", "weights_missing", "weights_are_text", "config_not_json",
                                  "config_does_not_fit", "tokenizer_broken", "a_classifier"])
def test_a_broken_hugging_face_dir_ends_in_one_line(assets, tmp_path, capsys, case):
    """Each as --backbone: exit 2, one line naming the dir and what failed, no traceback, nothing written."""
    backbone, expected = _broken_hf(assets, tmp_path, case)
    out = tmp_path / "out"
    args = rm_args(assets, out, "--max_steps", "1")
    args[1], args[3] = str(backbone), str(backbone)
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {backbone}") and expected in err, err
    assert not out.exists()


def test_a_model_and_a_reward_model_given_for_each_other_end_in_one_line(assets, tmp_path, capsys):
    rm = tmp_path / "rm"
    assert kat_train_rm.main(rm_args(assets, rm, "--max_steps", "1")) == 0
    capsys.readouterr()
    args = rm_args(assets, tmp_path / "out", "--max_steps", "1")
    args[1] = str(rm)
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a reward-model checkpoint, not a model: give it as --rm" in err, err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n' * 8)
    assert kat_train_grpo.main(["--policy", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--rm",
                                str(assets["gpt"]), "--prompts", str(prompts), "--device", "cpu", "--max_steps", "1",
                                "--out", str(tmp_path / "grpo")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a reward-model checkpoint" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "grpo").exists()


# ---- nothing from outside runs code ---------------------------------------------------------------
class _RunsACommand:
    """Unpickled, it would run `touch <marker>`: what a hostile tokenizer.pkl or checkpoint can hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("payload,expected", [
    ("command", "it names posix.system, which a nanochat tokenizer does not hold; refused before running anything"),
    ("by_name", "not a pickled tiktoken Encoding with fields name, pat_str, mergeable_ranks, special_tokens"),
])
def test_a_tokenizer_pickle_that_would_run_code_is_refused_in_one_line(assets, tmp_path, capsys, monkeypatch,
                                                                      payload, expected):
    """A pickled command is refused before anything runs; so is tiktoken's Encoding pickled by the name of a
    registered encoding, which tiktoken's own unpickling would fetch from the internet."""
    import tiktoken.registry

    marker = tmp_path / "ran"
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    if payload == "command":
        obj = _RunsACommand(marker)
    else:  # a registered encoding pickles as its name
        obj = TokenizerWrapper.load(assets["tokenizer"])._impl
        monkeypatch.setitem(tiktoken.registry.ENCODINGS, obj.name, obj)
    (tokenizer / "tokenizer.pkl").write_bytes(pickle.dumps(obj, protocol=4))
    args = rm_args(assets, tmp_path / "out", "--max_steps", "1")
    args[3] = str(tokenizer)
    assert kat_train_rm.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tokenizer / 'tokenizer.pkl'}: cannot read the tokenizer: UnpicklingError: {expected}" \
        if payload == "command" \
        else err == f"error: {tokenizer / 'tokenizer.pkl'}: cannot read the tokenizer: {expected}"
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_resume_state_that_would_run_code_is_refused(assets, tmp_path, capsys):
    """The resume state is read weights_only, like every checkpoint: tensors and plain data, nothing else. A
    hostile newest state is skipped, with the reason, for the checkpoint before it."""
    out, marker = tmp_path / "out", tmp_path / "ran"
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--save_every", "2")) == 0
    newest = max(out.glob("state_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    torch.save({**torch.load(newest, weights_only=True), "extra": _RunsACommand(marker)}, newest)
    capsys.readouterr()
    assert kat_train_rm.main(rm_args(assets, out, "--max_steps", "4", "--resume", "latest")) == 0
    printed = capsys.readouterr().out
    assert "holds objects other than tensors and plain data, which are refused (loading them could run code)" in printed
    assert "at step 2" in printed and not marker.exists()


# ---- reward functions -----------------------------------------------------------------------------
@pytest.mark.parametrize("fn,expected", [
    ("raises_runtime_error", "reward function raises_runtime_error on prompt "),
    ("returns_bool", "returned True (bool), not a real number"),
    ("returns_str", "returned '0.75' (str), not a real number"),
    ("returns_huge", "returned 1e+300, outside --reward_clip 10.0"),
])
def test_reward_function_failures_stop_every_rank_with_one_line(assets, tmp_path, capsys, fn, expected):
    args = ["--policy", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--prompts", str(assets["pairs"]),
            "--reward_fn", f"rewards_for_tests:{fn}", "--reward_clip", "10", "--batch_size", "2", "--group_size", "2",
            "--max_new_tokens", "4", "--max_steps", "1", "--device", "cpu", "--out", str(tmp_path / "g")]
    nproc = 2 if fn == "raises_runtime_error" else 1
    if nproc == 1:  # in this process (a launch costs more than the step); main's return is the script's exit code
        code = kat_train_grpo.main(args)
        printed = capsys.readouterr()
        proc = subprocess.CompletedProcess(args, code, printed.out, printed.err)
    else:
        proc = run_script("scripts.kat_train_grpo", args, nproc=nproc, env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
                          torchrun=True)
    assert_stopped(proc, 2, expected, nproc)
    assert "Connection closed by peer" not in proc.stderr
    if fn == "raises_runtime_error":  # #80 item 3: the user's row as the file numbers it; the traceback in the logs
        kept = tmp_path / "g" / "logs" / "traceback_rank0.txt"
        assert f"on prompt {assets['pairs']}:" in proc.stderr and f"(its traceback: {kept})" in proc.stderr, proc.stderr
        assert 'raise RuntimeError("the grader\'s service is down")' in kept.read_text()


def test_speedrun_repeats_the_failing_stages_error_line(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(f'{{"prompt": "question {i}", "chosen": "a", "rejected": "b"}}\n' for i in range(4)))
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path / "base"), "BACKBONE": str(tmp_path / "missing"),
           "PAIRS": str(pairs), "NPROC_PER_NODE": "1"}
    proc = subprocess.run(["bash", "speedrun.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # speedrun's own code for a failed stage, after the stage's one line and exit 2
    assert len([x for x in proc.stderr.splitlines() if x.startswith("error: ")]) == 1
    tail = proc.stderr.strip().splitlines()[-2:]
    assert tail[0].startswith("speedrun: stage density failed: ") and "backbone path does not exist" in tail[0], tail
    assert tail[1].startswith("speedrun: stage density needs a backbone")
