"""The demo's figures against what docs/pipeline.md says they are: `bash speedrun.sh` from an empty base dir, once per
seed, then each seed's reward-model accuracy and GRPO's sampled task accuracy held against the ranges the docs state
("the reward models reach A-B held-out accuracy ... to C-D"). Run it at every landing that touches a default the demo
reads (a trainer's default, the demo's recipe in speedrun.sh): a default that stops the demo learning fails here.

    python bench/demo_check.py --seeds 0 1 2 [--work /tmp/demo_check] [--out bench/results/demo_check_<date>.jsonl]

Prints one JSON line per seed and a verdict line; exits 1 when a seed's figure falls below the docs' range by more
than --slack (a new machine computes a little differently: the docs' ranges are seeds 0-2 on one machine).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "pipeline.md"
# The sentence in docs/pipeline.md#the-demo this check reads its ranges from.
RANGES = {"rm_accuracy": r"reward models reach ([0-9.]+)-([0-9.]+) held-out accuracy",
          "grpo_sampled": r"sampled task accuracy from [0-9.]+-[0-9.]+ \(SFT\) to ([0-9.]+)-([0-9.]+)"}


def documented_ranges(text: str) -> dict[str, tuple[float, float]]:
    """{figure: (low, high)} as the docs' demo paragraph states them; a figure it no longer states is an error."""
    ranges = {}
    for name, pattern in RANGES.items():
        found = re.search(pattern, " ".join(text.split()))
        if found is None:
            raise SystemExit(f"demo_check: {DOCS} no longer says /{pattern}/: update RANGES with the docs")
        ranges[name] = (float(found.group(1)), float(found.group(2)))
    return ranges


def figures(report: dict) -> dict[str, float]:
    """A demo report's figures: the lower of the two RMs' held-out accuracy, GRPO's and SFT's sampled accuracy, and
    the calculator's accuracy after GRPO."""
    policies = report["policies"]
    return {"rm_accuracy": min(m["overall"]["accuracy"] for m in report["reward_models"].values()),
            "sft_sampled": policies["before (SFT)"]["task_accuracy_sampled"],
            "grpo_sampled": policies["GRPO uniform"]["task_accuracy_sampled"],
            "grpo_calculator": policies["GRPO uniform"]["tool_use"]["accuracy_with_tools"]}


def shortfalls(found: dict[str, float], ranges: dict[str, tuple[float, float]], slack: float) -> list[str]:
    """One line per figure below its documented range by more than `slack`."""
    return [f"{name} {found[name]:.3f} < {low:.3f} - {slack} (docs: {low}-{high})"
            for name, (low, high) in ranges.items() if found[name] < low - slack]


def run_demo(base: Path, seed: int) -> tuple[dict, float]:
    """The demo from nothing in `base`: its report and its wall seconds."""
    shutil.rmtree(base, ignore_errors=True)
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), "SEED": str(seed)}
    t0 = time.time()
    with open(base.parent / f"{base.name}.log", "w") as log:
        code = subprocess.run(["bash", str(REPO / "speedrun.sh")], env=env,
                              stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"demo_check: speedrun.sh failed for seed {seed} (exit {code}; log {log.name})")
    return json.loads((base / "report.json").read_text()), time.time() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work", type=Path, default=Path("/tmp/demo_check"))
    p.add_argument("--out", type=Path, default=None, help="append each seed's JSON line here too")
    p.add_argument("--slack", type=float, default=0.02)
    args = p.parse_args()
    ranges = documented_ranges(DOCS.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    args.work.mkdir(parents=True, exist_ok=True)
    failed = []
    for seed in args.seeds:
        report, seconds = run_demo(args.work / f"seed_{seed}", seed)
        found = figures(report)
        row = {"bench": "demo_check", "commit": commit.strip(), "seed": seed, "wall_s": round(seconds, 1), **found,
               "docs": ranges}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        failed += [f"seed {seed}: {line}" for line in shortfalls(found, ranges, args.slack)]
    print("demo_check: " + ("; ".join(failed) if failed else f"every seed within the docs' ranges ({ranges})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
