"""Shared tiny assets, made once per test session: a RustBPE tokenizer trained on generated text,
tiny nanochat GPT checkpoints (classic and modern), a tiny Hugging Face Llama dir, pairs files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked import run_python
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from nanochat_ext.models.loader import load_backbone
from nanochat_ext.models.reward_model import RewardModel
from nanochat_ext.tasks import synthetic

REPO = Path(__file__).resolve().parents[1]
# Inductor's on-disk cache does not key its generated code by the kernels torch was told to use: C++
# written for AVX2 by one run is reused by a run with ATEN_CPU_CAPABILITY=default and fails to build there
# ("'at::vec' has not been declared"). One cache per capability, for this process and the subprocesses that
# inherit its environment.
_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
_capability = f"cpu_{torch.backends.cpu.get_cpu_capability().lower()}"
if os.path.basename(_cache) != _capability:  # a nested run inherits the parent's: no second suffix
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cache, _capability)
# Inductor compiles C++ kernels in a pool of one process per core, each importing torch: ~4 s of CPU per process
# that compiles (measured: the inductor engine test 28.7 -> 24.9 s of CPU), where the suite's two workers already
# keep both cores busy. In-process compiles instead, here and in the scripts the tests start; on a GPU machine
# (the CUDA tests) Triton's compiles keep their pool.
if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ and not torch.cuda.is_available():
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    inductor_config.compile_threads = 1  # read at import, which came before this line
# The longest tests start first (seconds of one worker in a suite on an AVX-512 machine, a cold inductor cache; "->":
# since trimmed, less the saving measured alone): pytest-xdist hands tests out in collection order, so one that starts
# late keeps its worker busy long after the other has finished. Longest first is the classic remedy.
LONGEST_FIRST = (
    "tests/test_pipeline.py::test_density_experiment_end_to_end_skips_and_resumes",  # 104
    "tests/test_lora.py::test_grpo_lora_in_bf16_compiled_starts_at_its_reference_and_merges",  # 119 (inductor)
    "tests/test_compiled.py::test_compiled_training_agrees_with_eager",  # 94 (inductor)
    "tests/test_compiled.py::test_compiled_step_one_starts_at_its_reference_and_old_policy",  # 95 -> 56 (inductor)
    "tests/test_bench.py::test_the_gpu_command_runs_at_a_tiny_shape_on_cpu",  # 48
    "tests/test_compiled.py::test_compiled_blocks_on_two_ranks_give_one_eager_ranks_gradients",  # 29 + 28 -> ~47
    "tests/test_fsdp.py::test_rm_on_fsdp_trains_as_ddp_and_one_rank_and_resumes_exactly_after_a_kill",  # 38
    "tests/test_compiled.py::test_compiled_llama_trains_at_new_lengths_as_eager",  # 36 (inductor)
    "tests/test_pipeline.py::test_your_model_runs_with_the_scripts_defaults_and_is_judged_on_held_out_prompts",  # 28
    "tests/test_healing.py::test_a_group_that_loses_a_rank_restarts_and_resumes_to_the_uninterrupted_result[grpo]",  # 27  # noqa: E501
    "tests/test_pipeline.py::test_the_density_experiment_on_a_model_runs_both_dpo_arms_on_its_own_words",  # ~30
    "tests/test_healing.py::test_a_group_that_loses_a_rank_restarts_and_resumes_to_the_uninterrupted_result[rm]",  # 25
    "tests/test_reliability.py::test_ctrl_c_on_two_ranks_with_the_pipe_gone_checkpoints_and_resumes_exactly",  # 22
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {nodeid: k for k, nodeid in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _cuda_test_timeout(request: pytest.FixtureRequest):
    """$CUDA_TEST_TIMEOUT seconds (bench/run_gpu.sh sets it) for each CUDA-marked test: past it the test fails
    (subprocess.run kills its child) and the next one runs, so one hung test does not spend a 10-minute GPU call."""
    limit = int(os.environ.get("CUDA_TEST_TIMEOUT", "0"))
    if not limit or request.node.get_closest_marker("cuda") is None:
        yield
        return

    def expire(*_):
        raise TimeoutError(f"{request.node.nodeid} ran past CUDA_TEST_TIMEOUT={limit} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture
def scalar_kernels():
    """Inductor's C++ without its vectorised (at::vec) kernels, for a test whose subject is what our graphs compute
    (a reference, a first ratio, a stride the backward asserts), not inductor's kernels: the same graphs and fusions,
    each loop scalar, which g++ compiles in ~30% less CPU (measured: test_compiled_step_one 68 -> 48 s of CPU,
    cold cache). Inductor's vectorised kernels stay under test in test_compiled_training_agrees_with_eager and
    test_engine's inductor tests."""
    with inductor_config.patch({"cpp.simdlen": 1}):  # no vector ISA has 1-bit lanes: pick_vec_isa finds none
        yield


# The suite runs on 2 cores: keep in-process work from fighting subprocesses. One thread also makes the
# in-process arithmetic the same whatever OMP_NUM_THREADS the caller set (subprocesses get 1 too).
torch.set_num_threads(1)


def ulps(*tensors: torch.Tensor, n: int = 4) -> float:
    """An absolute tolerance of n units in the last place at the largest magnitude among `tensors`, in
    their dtype: for comparing two computations of the same values in different orders (another chunking,
    batch or kernel), whose results differ by rounding alone. Which kernels torch picks depends on the CPU
    (AVX-512, AVX2 or neither), so such results are equal on some machines and a few ulps apart on others."""
    dtype = tensors[0].dtype
    largest = max(float(t.detach().abs().max()) for t in tensors)
    return n * torch.finfo(dtype).eps * max(largest, torch.finfo(dtype).tiny)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same computation repeated (a resumed run, a consolidated or merged checkpoint, a twin run): the same
    tensors, bitwise, naming those that differ."""
    assert got.keys() == want.keys(), (sorted(got.keys() ^ want.keys()))
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ


def assert_same_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], init: dict[str, torch.Tensor],
                       rel: float = 1e-2) -> None:
    """Two runs of the same steps in different computation orders (1 against 2 ranks, one batch against
    micro-batches, DDP against FSDP) end with the same weights, compared by the update: every tensor of `want` moved
    from `init`, and ||got - want|| / ||want - init|| <= rel. Not by a fixed tolerance on the weights: Adam turns the
    rounding in near-zero gradient entries into steps of about lr whatever their size, so such runs differ by a
    fraction of lr that depends on the CPU's kernels (AVX-512, AMX, AVX2 or none). Measured on the suite's runs: at
    most 6e-4 of the update with AVX-512, AVX2 and plain kernels; a micro-batch's or a rank's gradient left out makes
    it 0.15 to 1."""
    assert got.keys() == want.keys() and want.keys() <= init.keys()
    for k in want:
        moved = float((want[k].double() - init[k].double()).norm())
        assert moved > 0, f"{k} did not train"
        gap = float((got[k].double() - want[k].double()).norm()) / moved
        assert gap <= rel, f"{k}: the runs differ by {gap:.2e} of the update (allowed {rel:.0e})"


def assert_stopped(proc: subprocess.CompletedProcess, code: int, line: str, nproc: int = 1) -> None:
    """A run that stopped as docs/reliability.md promises: exit code `code` (under torchrun, its agent's
    1, its summary naming `code` and showing the line for the first rank that exited) and one `error: ` line holding
    `line`, said once also where every rank finds it by itself (a flag, a bad row, the same out of memory); no
    traceback through our code."""
    if nproc == 1:
        assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    else:
        assert proc.returncode == 1 and f"exitcode  : {code} " in proc.stderr, proc.stderr[-3000:]
        root_cause = proc.stderr.split("Root Cause (first observed failure):")[1]  # the line, not <N/A>
        assert "traceback : error: " in root_cause and line.removeprefix("error: ") in root_cause, root_cause
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and line in errors[0], errors
    assert not [x for x in proc.stderr.splitlines() if 'File "' in x and ("nanochat_ext" in x or "scripts" in x)]


def rm_init(backbone: Path, seed: int) -> dict[str, torch.Tensor]:
    """An RM's weights before its first step, as kat_train_rm makes them: the backbone as loaded, the head drawn
    by init_head from --seed."""
    model = RewardModel(load_backbone(backbone))
    model.init_head(seed)
    return model.state_dict()


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("assets")
    tok = synthetic.make_tokenizer(d / "tokenizer", vocab_size=512)
    synthetic.make_tiny_gpt(d / "gpt", tok.vocab_size, seed=0)
    synthetic.make_tiny_gpt(d / "gpt_modern", tok.vocab_size, seed=1, vintage="current")
    synthetic.make_tiny_gpt(d / "gpt_small_vocab", 300, seed=2)
    synthetic.make_tiny_hf_llama(d / "hf")
    synthetic.write_jsonl(d / "pairs.jsonl", synthetic.make_pairs(600, seed=0))
    return {"dir": d, "tokenizer": d / "tokenizer", "gpt": d / "gpt", "gpt_modern": d / "gpt_modern",
            "gpt_small_vocab": d / "gpt_small_vocab", "hf": d / "hf", "pairs": d / "pairs.jsonl"}


def launcher(nproc: int, torchrun: bool = False, max_restarts: int = 0) -> list[str]:
    """How `nproc` ranks start: plain python for one; torchrun where the test reads what its agent does (restarts, its
    summary of a failed rank), else tests/workers/launch.py, torchrun's environment without its agent (a launch ~2 s
    of CPU cheaper)."""
    if nproc == 1:
        return [sys.executable]
    if torchrun or max_restarts or os.environ.get("NANOCHAT_TEST_TORCHRUN") == "1":  # 1: torchrun everywhere
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                f"--max-restarts={max_restarts}"]
    return [sys.executable, str(REPO / "tests" / "workers" / "launch.py"), str(nproc)]


def run_script(module: str, args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 300,
               max_restarts: int = 0, torchrun: bool = False, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run `python -m scripts.X` (nproc 1), or its nproc ranks (launcher()), in cwd."""
    return run_command(["-m", module, *(["--"] if nproc > 1 else []), *args], nproc, env, cwd, timeout,
                       launcher(nproc, torchrun, max_restarts))


def run_command(command: list[str], nproc: int, env: dict | None, cwd: Path, timeout: float,
                agent: list[str]) -> subprocess.CompletedProcess:
    """`python COMMAND` on nproc ranks started by `agent` (launcher()), with the tests' environment plus env: under
    torchrun's agent where the test reads what it does, else a fork of the warm interpreter (forked.py)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    if "torch.distributed.run" in agent:
        return subprocess.run([*agent, *command], cwd=cwd, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    return run_python(command, nproc, full_env, cwd, timeout)


def run_worker(worker: str, assets: dict, nproc: int, n_micros: tuple[int, ...], out: Path,
               env: dict | None = None) -> dict:
    """Run tests/workers/<worker>.py on `nproc` gloo ranks (plain python for 1), splitting each rank's batch
    into each of n_micros micro-batches in turn, and load what rank 0 saved: {n_micro: results}. env: added
    to the workers' environment."""
    command = [str(REPO / "tests" / "workers" / f"{worker}.py"), str(assets["dir"]), ",".join(map(str, n_micros)),
               str(out)]
    proc = run_command(command, nproc, env, Path.cwd(), 300, launcher(nproc))
    assert proc.returncode == 0, proc.stderr
    return torch.load(out, weights_only=True)
