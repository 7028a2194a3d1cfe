"""What running the model's code sealed costs (sandbox/sandbox.py): seconds a CodeTests step takes, one at a time and
in a burst of concurrent steps (as a GRPO step's environment calls come), sealed beside unsealed where the machine
gives both, and beside the previous harness's cost (one `python -I` subprocess; --plain).

    python bench/bench_sandbox.py [--runs 20] [--burst 32]

One JSON line: median and p90 seconds of one step, steps/s in the burst, per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanochat_ext.sandbox import child as sandbox_child  # noqa: E402
from nanochat_ext.sandbox import sandbox
from nanochat_ext.tasks.code_checks import parse_tests  # noqa: E402
from nanochat_ext.tasks.code_tests import verdict  # noqa: E402

CODE = "def add(a, b):\n    return a + b"
TESTS = "assert add(2, 3) == 5\nassert add(-4, 1) == -3\nassert add(0, 0) == 0"


def step(mode: str) -> float:
    t0 = time.perf_counter()
    if mode == "plain python -I (the previous harness)":
        subprocess.run([sys.executable, "-I", "-c", CODE + "\n" + TESTS], capture_output=True, timeout=10)
    else:
        plan = parse_tests(TESTS)
        limits = sandbox.Limits(seconds=5)
        if mode == "sealed":
            run = sandbox.run(CODE, plan.steps, limits)
        else:
            with sandbox.RUNS:  # as run() holds it
                run = sandbox.launch(CODE, plan.steps, limits, isolate=False)
        assert verdict(run, plan, limits)[0], run
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--burst", type=int, default=32)
    args = p.parse_args()
    out = {"isolation": sandbox.isolation()}
    modes = ["plain python -I (the previous harness)"]
    modes += ["sealed"] * (sandbox.seal_trial() == "sealed")
    # unsealed runs as nobody where we are root, and not at all where nobody cannot read this Python
    modes += ["unsealed"] * (os.getuid() != 0 or sandbox_child.readable_by_others(sandbox_child.python_paths()))
    for mode in modes:
        one = sorted(step(mode) for _ in range(args.runs))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.burst) as pool:
            list(pool.map(lambda _: step(mode), range(args.burst)))
        out[mode] = {"median_s": round(statistics.median(one), 4), "p90_s": round(one[int(0.9 * len(one))], 4),
                     "burst_steps_per_s": round(args.burst / (time.perf_counter() - t0), 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
