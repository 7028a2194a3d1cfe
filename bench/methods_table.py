"""The markdown tables of bench/methods_real_model.sh's JSON lines: for each method (a run's label), held-out greedy
accuracy at every evaluated step as the mean over its seeds with the lowest and highest seed beside it, the training
seconds to its last step (evaluations left out), the whole training call's seconds (evaluations, loading and the last
save in: what --async_rollouts, whose next rollout runs during an evaluation, is timed by too) and its sampled
accuracy there; then each method's last greedy accuracy minus GRPO's, seed by
seed (the same seed draws the same prompts first, so the pairs share their luck).

    python bench/methods_table.py bench/results/methods_real_model_<date>.jsonl [--plot PNG]

--plot: each method's mean curve, held-out greedy accuracy against mean training seconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from real_model_table import plot_curves, read_results

CURVE, SUMMARY = "ours_time_to_accuracy", "ours_time_to_accuracy_summary"
BASELINE = "grpo"


def runs(rows: list[dict]) -> dict[str, dict[int, list[dict]]]:
    """{label: {seed: its curve by step}} for every run whose summary was written (a run cut short has none); a
    later line of the same run and step replaces an earlier one."""
    finished = {(r["label"], r["seed"]) for r in rows if r.get("bench") == SUMMARY}
    points: dict[tuple, dict] = {}
    for r in rows:
        if r.get("bench") == CURVE and (r.get("label"), r.get("seed")) in finished:
            points[r["label"], r["seed"], r["step"]] = r
    out: dict[str, dict[int, list[dict]]] = {}
    for (label, seed, _), r in sorted(points.items()):
        out.setdefault(label, {}).setdefault(seed, []).append(r)
    return out


def by_step(seeds: dict[int, list[dict]]) -> list[dict[int, dict]]:
    """Each seed's curve as {step: its point}."""
    return [{r["step"]: r for r in curve} for curve in seeds.values()]


def spread(values: list[float]) -> str:
    """'mean (lowest-highest)', or the value alone for one seed."""
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})"


def call_seconds(values: list[float | None]) -> str:
    """The mean call seconds, or '-' where a summary predates them."""
    return "-" if None in values else f"{statistics.fmean(values):.1f}"


def table(rows: list[dict]) -> str:
    by_label = runs(rows)
    steps = sorted({r["step"] for seeds in by_label.values() for curve in seeds.values() for r in curve})
    lines = ["Held-out greedy accuracy, mean over seeds (lowest-highest seed)", "",
             "| method | seeds | " + " | ".join(f"step {s}" for s in steps) +
             " | sampled, last step | training s | call s |",
             "|---|---|" + "---|" * (len(steps) + 3)]
    calls = {(r["label"], r["seed"]): r.get("train_call_s") for r in rows if r.get("bench") == SUMMARY}
    for label, seeds in by_label.items():
        at = by_step(seeds)
        cells = [spread([a[s]["greedy_accuracy"] for a in at]) if all(s in a for a in at) else "-" for s in steps]
        last = [curve[-1] for curve in seeds.values()]
        lines.append(f"| {label} | {' '.join(map(str, seeds))} | " + " | ".join(cells) +
                     f" | {spread([r['sampled_accuracy'] for r in last])} | "
                     f"{statistics.fmean(r['train_s'] for r in last):.1f} | "
                     f"{call_seconds([calls[label, s] for s in seeds])} |")
    if BASELINE in by_label:
        base = {seed: curve[-1]["greedy_accuracy"] for seed, curve in by_label[BASELINE].items()}
        lines += ["", f"Last greedy accuracy minus {BASELINE}'s, seed by seed", "",
                  "| method | per seed | mean |", "|---|---|---|"]
        for label, seeds in by_label.items():
            diffs = {s: c[-1]["greedy_accuracy"] - base[s] for s, c in seeds.items() if s in base and label != BASELINE}
            if diffs:
                lines.append(f"| {label} | " + ", ".join(f"{d:+.3f} (seed {s})" for s, d in diffs.items()) +
                             f" | {statistics.fmean(diffs.values()):+.3f} |")
    return "\n".join(lines)


def mean_curves(rows: list[dict]) -> dict[str, list[dict]]:
    """Each method's curve averaged over its seeds at the steps all of them evaluated."""
    out = {}
    for label, seeds in runs(rows).items():
        at = by_step(seeds)
        steps = sorted(set.intersection(*(set(a) for a in at)))
        out[label] = [{"train_s": statistics.fmean(a[s]["train_s"] for a in at),
                       "greedy_accuracy": statistics.fmean(a[s]["greedy_accuracy"] for a in at)} for s in steps]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="methods_real_model.sh's JSON lines")
    p.add_argument("--plot", default=None, metavar="PNG", help="write each method's mean curve there")
    args = p.parse_args(argv)
    try:
        rows = read_results(Path(args.results))
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    print(table(rows))
    if args.plot:
        plot_curves(mean_curves(rows), Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
