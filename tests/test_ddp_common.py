"""Launcher detection and collectives, with real gloo groups started the way each launcher would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, ulps
from workers.dist_worker import REWARDS, TOKENS

from nanochat_ext.algorithms.advantages import advantages
from nanochat_ext.algorithms.rollout_batch import RolloutBatch
from nanochat_ext.ddp_common import (
    all_reduce_sum,
    broadcast_object,
    destroy_dist,
    detect_launcher,
    free_port,
    init_dist,
)

LAUNCHER_ENVS = {
    "torchrun": lambda r: {"RANK": r, "LOCAL_RANK": r, "WORLD_SIZE": "2"},
    "openmpi": lambda r: {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_LOCAL_RANK": r, "OMPI_COMM_WORLD_SIZE": "2"},
    "mvapich2": lambda r: {"MV2_COMM_WORLD_RANK": r, "MV2_COMM_WORLD_LOCAL_RANK": r, "MV2_COMM_WORLD_SIZE": "2"},
    "slurm": lambda r: {"SLURM_PROCID": r, "SLURM_LOCALID": r, "SLURM_NTASKS": "2"},
}


@pytest.mark.parametrize("launcher", LAUNCHER_ENVS)
def test_detect_launcher(launcher):
    assert detect_launcher(LAUNCHER_ENVS[launcher]("1")) == (launcher, 1, 1, 2)


def test_plain_run_needs_no_launcher(monkeypatch):
    for names in LAUNCHER_ENVS.values():
        for var in names("0"):
            monkeypatch.delenv(var, raising=False)
    env = init_dist("cpu")
    assert (env.rank, env.world_size, env.backend, env.launcher, env.is_main) == (0, 1, None, "none", True)


def _launch_two(launcher: str, *worker_args: str) -> list[dict]:
    base = {k: v for k, v in os.environ.items()
            if not any(k in LAUNCHER_ENVS[n]("0") for n in LAUNCHER_ENVS)}
    base.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "workers" / "dist_worker.py"), *worker_args],
                              env={**base, **LAUNCHER_ENVS[launcher](str(r))}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    return sorted((json.loads(o.strip().splitlines()[-1]) for o, _ in outs), key=lambda d: d["rank"])


def test_one_rank_with_a_backend_creates_the_group(monkeypatch):
    """--backend with world size 1 runs the whole process-group path (one GPU exercises NCCL this way)."""
    for names in LAUNCHER_ENVS.values():
        for var in names("0"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = init_dist("cpu", "gloo")
    try:
        assert env.is_distributed and env.world_size == 1 and dist.is_initialized()
        assert all_reduce_sum(2.5) == 2.5 and broadcast_object("x") == "x"
    finally:
        destroy_dist()
    assert not dist.is_initialized()


def test_collectives_obey_nccls_device_rule():
    """A default group that serves only CUDA tensors (cuda:gloo, NCCL's rule on a CPU machine): every
    helper still works with CPU tensors, numbers, objects and a DDP module, while the same CPU tensor
    handed straight to the default group is refused exactly as NCCL refuses it. --scale_rewards batch's advantages
    (one all-reduce of the sums), GRPO's and RLOO's, and REINFORCE++'s per-token ones (whitened over every rank's
    tokens), on 2 ranks are those of the whole batch in one process."""
    results = _launch_two("torchrun", "cuda:gloo")
    for r in results:
        assert r["backend"] == "cuda:gloo" and r["sum"] == 3.0 and r["tensor_sum"] == [2.0, 1.0] and r["max"] == 1.0
        assert r["stamp"] == 1000 and r["gathered"] == [{"rank": 0}, {"rank": 1}] and r["in_sync"]
        assert r["ddp_grad"] == [[1.5, 1.5]]  # mean of the ranks' inputs 1 and 2
        assert r["raw_error"] == "No backend type associated with device type cpu"
    # --scale_rewards batch: 2 ranks' halves = the whole batch in one process
    for key in results[0]["batch_advantages"]:
        estimator, std_mode = key.split("/")
        got = torch.tensor(results[0]["batch_advantages"][key] + results[1]["batch_advantages"][key])
        want = advantages(estimator, REWARDS, 4, "batch", std_mode, RolloutBatch(**TOKENS), 0.05, "k2")
        torch.testing.assert_close(got, want, atol=ulps(want), rtol=0, msg=key)
    assert len(results[0]["batch_advantages"]) == 5  # GRPO's and RLOO's (sample and population std), REINFORCE++'s


@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_real_group_under_mpirun_and_srun_environments(launcher):
    results = _launch_two(launcher)
    for r in results:
        assert (r["world"], r["launcher"], r["backend"]) == (2, launcher, "gloo")
        assert r["sum"] == 3.0  # (0+1) + (1+1)
        assert r["stamp"] == 1000  # rank 0's object on every rank
        assert r["in_sync"]


def test_params_out_of_sync_are_caught():
    results = _launch_two("torchrun", "diverge")
    assert [r["in_sync"] for r in results] == [False, False]
