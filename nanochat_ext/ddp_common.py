"""Process-group plumbing shared by every script: launcher detection, init/cleanup, rank gating,
reductions, broadcasts, no_sync and seeding.

A plain `python -m scripts.X` run needs no launcher and no env vars: it is world size 1 and no
process group is created, unless --backend asks for one (then one GPU runs the real NCCL path).
Under torchrun, mpirun (OpenMPI / MVAPICH2) or srun the rank variables are read from the
launcher's environment and a real process group is created (nccl on CUDA, gloo on CPU).

Devices and backends: an nccl group serves CUDA tensors only; gloo serves CPU (and CUDA) tensors.
Every collective here picks its group by the tensor's device: CUDA tensors go to the default group,
CPU tensors to a group that serves CPU (the default one when its backend does, else a gloo group
made beside it). Objects and barriers always use the CPU group. So a helper is right for any tensor
on any backend, by construction, and callers never move tensors for a collective's sake.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nanochat_ext.errors import InputError

# (rank, local_rank, world_size) variable names, in the order we look for them.
_LAUNCHERS = {
    "torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    "mvapich2": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
}


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    launcher: str  # "none" for a plain single-process run
    backend: str | None  # None when no process group was created

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def detect_launcher(environ: dict[str, str] | None = None) -> tuple[str, int, int, int]:
    """Return (launcher, rank, local_rank, world_size) from the environment; ("none", 0, 0, 1) if none."""
    env = os.environ if environ is None else environ
    for name, (r, lr, ws) in _LAUNCHERS.items():
        if r in env and ws in env:
            return name, int(env[r]), int(env.get(lr, 0)), int(env[ws])
    return "none", 0, 0, 1


def pick_device(device: str, local_rank: int) -> torch.device:
    """'auto' -> cuda:<local_rank> when CUDA is available, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda was asked for but CUDA is not available")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device != "cpu":
        raise InputError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device("cpu")


_CPU_GROUP: Any = None  # the group CPU tensors, objects and barriers use (see the module docstring)
_THREAD = threading.local()  # a thread's own group for them (in_group): a rollout thread's, beside the training's
_TIMEOUT: datetime.timedelta | None = None  # the run's collectives' timeout (init_dist's)


def cpu_group() -> Any:
    """The group this thread's CPU collectives use: its own (in_group), else the run's."""
    return getattr(_THREAD, "group", None) or _CPU_GROUP


def side_group() -> Any:
    """Collective: a new gloo group over every rank, for a thread whose collectives run while the main thread's do
    (one group's collectives must come in one order on every rank: two threads on one group would interleave them
    differently and hang). None without a process group."""
    if not _is_dist():
        return None
    return dist.new_group(backend="gloo", **({"timeout": _TIMEOUT} if _TIMEOUT is not None else {}))


@contextlib.contextmanager
def in_group(group: Any) -> Iterator[None]:
    """This thread's CPU collectives (gather_objects, raise_if_any, ...) on `group` meanwhile."""
    _THREAD.group = group
    try:
        yield
    finally:
        _THREAD.group = None


def served_device_types(backend: str) -> set[str]:
    """Device types a backend string serves: 'nccl' -> {cuda}; 'cpu:gloo,cuda:nccl' -> {cpu, cuda};
    gloo (and mpi, ucc) -> both."""
    if ":" in backend:
        return {pair.split(":")[0].strip() for pair in backend.split(",")}
    return {"cuda"} if backend == "nccl" else {"cpu", "cuda"}


def init_dist(device: str = "auto", backend: str | None = None, timeout_s: float = 1800.0,
              group: bool = False) -> DistEnv:
    """Set up this process: pick the device and, when launched with world size > 1, asked for a
    backend explicitly or for a group (group=True), the process group."""
    global _CPU_GROUP, _TIMEOUT
    launcher, rank, local_rank, world_size = detect_launcher()
    dev = pick_device(device, local_rank)
    if world_size == 1 and backend is None and not group:
        return DistEnv(rank, local_rank, 1, dev, launcher, None)
    # mpirun / srun (and a plain one-process run) do not set the rendezvous address; torchrun does.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port()) if world_size == 1 else "29500"
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    timeout = _TIMEOUT = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = dict(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    if "nccl" in backend:
        kwargs["device_id"] = dev  # binds the communicator to our GPU up front
    store = attempt_store(timeout)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)
    serves_cpu = "cpu" in served_device_types(backend)
    _CPU_GROUP = dist.group.WORLD if serves_cpu else dist.new_group(backend="gloo", timeout=timeout)
    return DistEnv(rank, local_rank, world_size, dev, launcher, backend)


def restart_attempt() -> int:
    """Which start of torchrun's worker group this is: 0 the first, k the k-th restart (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun: its agent's store, with this attempt's keys under a prefix of their own; None elsewhere.
    The agent keeps one store for the whole job, and the process group's keys (each rank's address, NCCL's unique
    id) have the same names on every attempt, so a restarted rank can read a dead peer's address and never connect
    (measured: 4 of 6 two-rank gloo restarts after a SIGKILL; torch's env:// rendezvous assumes a new store per
    attempt). A prefix per attempt is what that rendezvous did before the store was shared; and one per group this
    process makes, since torch names every default group alike: a second run in one process (nanochat_ext.api's
    calls one after another, every rank making the same calls) must not read the first's keys while a peer may
    still be tearing it down (seen: the second call hung)."""
    agent = agent_store(timeout)
    return None if agent is None else dist.PrefixStore(f"nanochat_ext/attempt_{restart_attempt()}/"
                                                       f"group_{next(_GROUPS_MADE)}/", agent)


_AGENT_STORE: Any = None
_GROUPS_MADE = itertools.count()  # process groups this process has made: every rank makes the same ones, in order


def agent_store(timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> dist.Store | None:
    """Under torchrun: a client of its agent's store, which lives as long as the job, across restarts; else None.
    (Not where torchrun is told not to share its store, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: workers then
    rendezvous in a store of rank 0's.)"""
    global _AGENT_STORE
    if _AGENT_STORE is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _AGENT_STORE = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                     timeout=timeout)
    return _AGENT_STORE


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_for(device: torch.device) -> Any:
    """The process group that serves tensors on `device` (None: the default group)."""
    return cpu_group() if device.type == "cpu" else None


@contextlib.contextmanager
def dist_session(device: str = "auto", backend: str | None = None, timeout_s: float = 1800.0,
                 group: bool = False) -> Iterator[DistEnv]:
    """init_dist(), and always destroy the group on the way out, exceptions included; the rendezvous variables
    init_dist sets are as they were before (a caller's next session picks its own port)."""
    rendezvous = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    try:
        env = init_dist(device, backend, timeout_s, group)
        try:
            yield env
            barrier()
        except InputError:
            barrier()  # bad input is raised on every rank (validation is collective), so all get here
            raise
        finally:
            # Every rank passes the barrier before any tears down: gloo otherwise aborts a rank at exit
            # ("terminate called without an active exception", SIGABRT) when a peer has already gone.
            # Other exceptions skip it: a rank that crashed alone would leave the others waiting.
            destroy_dist()
    finally:  # a group that did not start too
        for k, v in rendezvous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def destroy_dist() -> None:
    """Free what still holds the process groups, then destroy them. A DDP module's reducer keeps its
    group alive; if the module (often in a reference cycle) outlives destroy_process_group, gloo's
    worker threads are torn down during interpreter finalization and abort the process (SIGABRT,
    "terminate called without an active exception"; measured 7 of 20 2-rank runs under CPU load)."""
    global _CPU_GROUP
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _is_dist() else 1


def is_main() -> bool:
    return get_rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def barrier() -> None:
    if _is_dist():
        dist.barrier(group=cpu_group())


def all_reduce_sum(x: torch.Tensor | float) -> torch.Tensor | float:
    """Sum over ranks, for a tensor on any device (reduced in place) or a Python number (float64, to
    keep sums exact)."""
    if isinstance(x, torch.Tensor):
        if _is_dist():
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group_for(x.device))
        return x
    return all_reduce_sum(torch.tensor([float(x)], dtype=torch.float64)).item()


def all_reduce_max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    if _is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return t.item()


def all_reduce_min(x: float) -> float:
    return -all_reduce_max(-x)


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Collective on CUDA: the largest torch.cuda.max_memory_allocated over ranks, in GiB; {} on CPU."""
    if device.type != "cuda":
        return {}
    return {"perf/max_mem_allocated_gb": all_reduce_max(torch.cuda.max_memory_allocated(device) / 2**30)}


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank (run stamp, resolved paths, an error message)."""
    if not _is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=cpu_group())
    return box[0]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def raise_if_any(error: str | None, cause: BaseException | None = None) -> None:
    """Collective: raise InputError on every rank if any rank has an error (the first one's text), from `cause` on
    the rank that had it (a user's function's traceback stays in the chain there).

    Checks that only one rank can make (is the output dir writable?) must stop all ranks, or the
    others hang in the next collective.
    """
    first = next((e for e in gather_objects(error) if e), None)
    if first:
        e = InputError(first)
        e.collective = True  # the same error on every rank: rank 0 reports it
        raise e from (cause if first == error else None)


def wrap_ddp(module: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """DDP over the module's trainable parameters only; frozen ones are neither broadcast nor reduced.
    Returns the module itself on a single rank."""
    if not env.is_distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    frozen += [n for n, _ in module.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(module, frozen)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, process_group=group_for(env.device))


@torch.no_grad()
def check_params_in_sync(params: list[torch.Tensor]) -> None:
    """Collective: raise if any rank's parameters differ from rank 0's (bitwise). Catches the
    classic failure of a "DDP" trainer whose ranks silently train separate copies."""
    if not _is_dist() or not params:
        return
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    group = group_for(flat.device)
    reference = flat.clone()
    dist.broadcast(reference, src=0, group=group)
    diff = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    if diff.item() != 0.0:
        raise RuntimeError(f"trainable parameters differ across ranks (max abs diff {diff.item():.3g})")


def gather_objects(obj: Any) -> list[Any]:
    """Collective: every rank's object, in rank order, on every rank (small results: eval rows)."""
    if not _is_dist():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out


def is_sharded(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (a shard of an FSDP parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def whole(t: torch.Tensor) -> torch.Tensor:
    """t itself, or, for a DTensor, the whole tensor all-gathered from its shards (collective)."""
    return t.full_tensor() if is_sharded(t) else t
