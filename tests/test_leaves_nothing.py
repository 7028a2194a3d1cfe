"""Nothing a run makes outlives it (#94), however it ends: a GRPO run whose environment runs each row's own code (the
hostile catalog beside looping neighbours and solutions, tests/tools_for_tests.py:RowsCode), stopped by SIGTERM on 2
ranks with the next rollout played in the rollout thread, and ended in one line by bad input. After each: no process
the run started (sampled while it ran: its ranks, their sandboxes and the code in them), no sandbox cgroup named after
one of them, no shared-memory segment of theirs, nothing in its temp dir or its working directory, no new file in the
repository. A listening socket lives only while a process holds it: no process, no socket. The run that ends 0 is
test_sandbox's catalog test (in process: no process, file or rollout thread left), and the cgroups' own ends are
test_sandbox's cgroup tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO
from test_sandbox import HOSTILE, SOLVED, TESTS, own_cgroups

from nanochat_ext.sandbox import sandbox
from nanochat_ext.tasks import synthetic

CATALOG = ["a busy loop", "many children", "a child that outlives the step", "killing its parent",
           "a forged results record"]


def started(pid: int) -> tuple[int, int] | None:
    """(pid, its start time in ticks): a process, not a reused number; None once it is gone."""
    try:
        return pid, int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def tree(pid: int) -> set[tuple[int, int]]:
    """pid and its living descendants, each as `started` names it."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if (s := started(p)) is None:
            continue
        found.add(s)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


class Watch:
    """Every process of a run's tree, sampled every 50 ms while it runs (a sandbox lives a few seconds at most)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self.done = proc, set(), threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done.is_set():
            self.seen |= tree(self.proc.pid)
            time.sleep(0.05)

    def stop(self) -> set[tuple[int, int]]:
        self.done.set()
        self.thread.join()
        return self.seen


def untracked() -> set[str]:
    return set(subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                              capture_output=True, text=True).stdout.splitlines())


def nothing_left(seen: set[tuple[int, int]], tmp: Path, cwd: Path, repo_before: set[str]) -> None:
    """What the run made is gone (its processes may take the kernel a moment to reap)."""
    deadline = time.monotonic() + 5
    while [s for s in seen if started(s[0]) == s] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [s for s in seen if started(s[0]) == s], "a process of the run outlived it"
    pids = {pid for pid, _ in seen}
    if "cgroup" in sandbox.isolation():
        assert not [d for pid in pids for d in own_cgroups(pid)]
    else:
        print(f"no cgroup here ({sandbox.isolation()}): the cgroup part is not checked")
    assert not [e.name for e in Path("/dev/shm").iterdir() if any(f"_{pid}_" in e.name for pid in pids)]
    # torchrun's agent (torch's, not the run's) keeps its log dir, empty directories only, after every run
    agents = [p for d in tmp.glob("torchelastic_*") for p in d.rglob("*")]
    assert not [p for p in agents if not p.is_dir()]
    assert not [p for p in tmp.iterdir() if not p.name.startswith("torchelastic_")] and not list(cwd.iterdir())
    assert untracked() <= repo_before


def grpo(rows: list[dict], tmp_path: Path, nproc: int, *flags: str) -> tuple[subprocess.Popen, Path, Path]:
    """A GRPO run on the tiny chat model (it ends its turns) whose environment runs each row's code, started with its
    own temp dir and working directory (both empty), in a session of its own; returns it, and them."""
    prompts = synthetic.write_jsonl(tmp_path / "prompts.jsonl", rows)
    tmp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmp.mkdir(), cwd.mkdir()
    args = ["--policy", str(REPO / "tests" / "fixtures" / "hf-tool-use"), "--prompts", str(prompts),
            "--env", "tools_for_tests:RowsCode", "--tool_timeout", "4", "--max_turns", "1", "--group_size", "2",
            "--max_new_tokens", "48", "--val_ratio", "0",
            "--device", "cpu", "--out", str(tmp_path / "out"), *flags]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, *launch, "-m", "scripts.kat_train_grpo", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, tmp, cwd


def rows_of(cases: list[str]) -> list[dict]:
    code = {**{name: HOSTILE[name][0] for name in CATALOG}, "solved": SOLVED, "text": SOLVED}
    return [{"prompt": f"Write add, attempt {k}.", "code": code[case], "tests": TESTS, "case": case}
            for k, case in enumerate(cases)]


def test_a_run_stopped_by_sigterm_on_two_ranks_leaves_nothing(tmp_path):
    """SIGTERM to the run's process group (SLURM's way) at step 1's line, the next rollout's code running in the
    rollout thread: the ranks finish the step, checkpoint and exit (torchrun's agent, signalled too, exits 1 after
    its SignalException's traceback, as test_reliability says)."""
    repo_before = untracked()
    proc, tmp, cwd = grpo(rows_of([*CATALOG, "solved", "solved", "solved"]), tmp_path, 2, "--batch_size", "4",
                          "--max_steps", "50", "--async_rollouts", "1", "--log_every", "1")
    watch, said = Watch(proc), []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("grpo step 1 "):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    said += proc.stdout.readlines()
    proc.wait(timeout=120)
    seen = watch.stop()
    assert proc.returncode != 0, "".join(said)[-3000:]
    log = (tmp_path / "out" / "logs" / "console.log").read_text()
    assert [x for x in log.splitlines() if x.startswith("interrupted at step ")], log[-3000:]
    nothing_left(seen, tmp, cwd, repo_before)


def test_a_run_ended_by_bad_input_mid_step_leaves_nothing(tmp_path):
    """An environment whose reward is text, beside rows whose code loops, forks and outlives its step: the run ends
    in one line naming it."""
    repo_before = untracked()
    proc, tmp, cwd = grpo(rows_of([*CATALOG, "text", "text", "text"]), tmp_path, 1, "--batch_size", "8",
                          "--max_steps", "2")
    watch = Watch(proc)
    said = proc.stdout.read()
    proc.wait(timeout=120)
    seen = watch.stop()
    assert proc.returncode == 2, said[-3000:]
    assert "returned '0.75' (str), not a real number" in said.strip().splitlines()[-1], said[-3000:]
    nothing_left(seen, tmp, cwd, repo_before)
