"""Code checked by tests: the example environment in which the model's code runs (docs/tools.md). It runs in a
subprocess of its own, never in the trainer's process, and never through `eval`.

Each prompt row carries "tests": Python source, typically asserts (`assert add(2, 3) == 5`). After each assistant
turn the environment takes the turn's last ```python block (or the whole turn, where it has none), runs it followed by
the tests in a fresh `python -I` (isolated: no environment variables, no user site-packages) in an empty temporary
directory, under limits on its CPU time, memory and file size and a wall-clock timeout, and answers with what failed
(the last line of the error) so that the model can try again; the episode ends when every test passes. Its reward is
1 if they passed, else 0.

    python -m scripts.kat_train_grpo --policy ... --prompts problems.jsonl \
        --env nanochat_ext.tasks.code_tests:CodeTests --max_turns 3
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TIME_LIMIT = 5.0  # seconds of wall clock (and of CPU) a run may take
MEMORY_MB = 512  # address space a run may map
FILE_MB = 1  # largest file a run may write
# Applied inside the child before the code runs: limits that cannot be raised again by the code they bind.
LIMITS = """import resource, runpy, sys
cpu, memory, files = {cpu}, {memory}, {files}
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the limit; SIGKILL a second on
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
runpy.run_path("main.py", run_name="__main__")
"""
CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def run_tests(code: str, tests: str, time_limit: float = TIME_LIMIT, memory_mb: int = MEMORY_MB) -> tuple[bool, str]:
    """(passed, what the model reads): the code followed by the tests, run in a subprocess under the limits."""
    with tempfile.TemporaryDirectory() as d:
        Path(d, "main.py").write_text(code + "\n\n" + tests + "\n")
        setup = LIMITS.format(cpu=max(int(time_limit), 1), memory=memory_mb << 20, files=FILE_MB << 20)
        try:
            done = subprocess.run([sys.executable, "-I", "-c", setup], cwd=d, capture_output=True, text=True,
                                  timeout=time_limit, env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False, f"timed out after {time_limit:g} s"
    if done.returncode == 0:
        return True, "all tests passed"
    if done.returncode < 0:  # ended by a signal: the CPU limit's (SIGXCPU, or SIGKILL past it), or another
        return False, f"killed by {signal.Signals(-done.returncode).name} (CPU time limit {max(int(time_limit), 1)} s)"
    lines = done.stderr.strip().splitlines()
    return False, (lines[-1] if lines else f"exit code {done.returncode}")[:300]


class CodeTests:
    """One rollout's attempts at a problem: each assistant turn's code is run against the row's tests."""

    def __init__(self, row: dict, time_limit: float = TIME_LIMIT):
        self.tests, self.time_limit = row["tests"], time_limit
        self.passed = False

    def step(self, reply: str) -> str | None:
        """The failure to fix, as the next user turn; None once every test passes."""
        blocks = CODE_BLOCK.findall(reply)
        self.passed, said = run_tests(blocks[-1] if blocks else reply, self.tests, self.time_limit)
        return None if self.passed else f"The tests failed: {said}. Fix the code."

    def get_reward(self) -> float:
        return float(self.passed)
