"""Does a row's code reward depend on its neighbours or the machine's load? (issue 79's acceptance run)

One decode step's environment calls, as GRPO makes them (agent/toolbox.call_all over CodeTests.step, the code's
limit --tool_timeout less a second): 8 rows whose code loops forever and 2 correct rows, on each of --ranks
processes at once (each rank has its own sandbox slots, as under torchrun), with --load busy processes beside them.
A run passes when every correct row scores 1 within --tool_timeout.

    python bench/sandbox_fairness.py --ranks 1 --runs 20 --load 2 --tool_timeout 4

One JSON line: runs, runs in which every correct row on every rank scored 1, and the slowest correct row's seconds.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanochat_ext.agent import toolbox  # noqa: E402
from nanochat_ext.sandbox import sandbox  # noqa: E402
from nanochat_ext.tasks.code_tests import CodeTests  # noqa: E402

TESTS = "assert add(2, 3) == 5\nassert add(-4, 1) == -3"
LOOP = "```python\nwhile True:\n    pass\n```"
SOLVED = "```python\ndef add(a, b):\n    return a + b\n```"


def one_step(tool_timeout: float) -> tuple[bool, float]:
    """(every correct row scored 1, the slowest correct row's seconds) for one step's 10 calls."""
    replies = [LOOP] * 8 + [SOLVED] * 2
    games = [CodeTests({"tests": TESTS}, time_limit=max(tool_timeout - 1.0, tool_timeout / 2)) for _ in replies]
    took = [0.0] * len(replies)

    def call(k: int):
        t0 = time.monotonic()
        try:
            return games[k].step(replies[k])
        finally:
            took[k] = time.monotonic() - t0

    out = toolbox.call_all([(f"row {k}", lambda k=k: call(k)) for k in range(len(replies))], tool_timeout,
                           text=False)
    ok = all(not o.timed_out and g.get_reward() == 1.0 for o, g in zip(out[8:], games[8:]))
    return ok, max(took[8:])


def rank(runs: int, tool_timeout: float, start, results) -> None:
    sandbox.seal_trial()
    start.wait()
    results.put([one_step(tool_timeout) for _ in range(runs)])


def burn(stop) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--load", type=int, default=2, help="busy processes beside the ranks")
    p.add_argument("--tool_timeout", type=float, default=4.0)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    start, stop, results = ctx.Barrier(args.ranks), ctx.Event(), ctx.Queue()
    burners = [ctx.Process(target=burn, args=(stop,)) for _ in range(args.load)]
    ranks = [ctx.Process(target=rank, args=(args.runs, args.tool_timeout, start, results)) for _ in range(args.ranks)]
    for proc in burners + ranks:
        proc.start()
    got = [results.get() for _ in ranks]
    stop.set()
    for proc in burners + ranks:
        proc.join()
    per_run = [all(r[k][0] for r in got) for k in range(args.runs)]
    print(json.dumps({"ranks": args.ranks, "load": args.load, "tool_timeout": args.tool_timeout, "runs": args.runs,
                      "all_correct_scored_1": sum(per_run), "slowest_correct_s": round(max(s for r in got
                                                                                             for _, s in r), 2),
                      "isolation": sandbox.isolation()}))


if __name__ == "__main__":
    main()
