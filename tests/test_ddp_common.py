"""Launcher detection and collectives, with real gloo groups started the way each launcher would."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO
from nanochat_ext.ddp_common import detect_launcher, init_dist

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two(launcher: str, *worker_args: str) -> list[dict]:
    base = {k: v for k, v in os.environ.items()
            if not any(k in LAUNCHER_ENVS[n]("0") for n in LAUNCHER_ENVS)}
    base.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "workers" / "dist_worker.py"), *worker_args],
                              env={**base, **LAUNCHER_ENVS[launcher](str(r))}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    return sorted((json.loads(o.strip().splitlines()[-1]) for o, _ in outs), key=lambda d: d["rank"])


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
