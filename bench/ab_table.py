"""bench/ab.sh's table: for each bench, its figure's median over the rounds and range (min-max) on each tree, and
NEW / OLD of the medians, in markdown.

    python bench/ab_table.py RUNS.jsonl OLD NEW
"""
import json
import statistics
import sys

FIGURE = {"grpo": "completions_per_s", "smollm2_grpo": "completions_per_s", "rm": "pairs_per_s", "dpo": "pairs_per_s"}


def table(runs: list[dict], old: str, new: str) -> str:
    lines = [f"| bench (figure) | {old} (old): median [min-max] | {new} (new): median [min-max] | new / old |",
             "|---|---|---|---|"]
    for bench in dict.fromkeys(r["ab_bench"] for r in runs):
        figure = FIGURE[bench]
        cells, medians = [], []
        for tree in ("old", "new"):
            values = [r[figure] for r in runs if r["ab_bench"] == bench and r["tree"] == tree]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.2f} [{min(values):.2f}-{max(values):.2f}] (n={len(values)})")
        lines.append(f"| {bench} ({figure}) | {cells[0]} | {cells[1]} | {medians[1] / medians[0]:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    path, old, new = sys.argv[1:4]
    print(table([json.loads(line) for line in open(path) if line.strip()], old, new))
