"""The markdown table of bench/bench_real_model.sh's JSON lines (for each part, its last sitting in the file): GRPO
completions/s of ours and TRL's (medians over the repeats, and their ratio), then time to accuracy: for each
threshold the training seconds (evaluations left out) at which each first reached that held-out greedy accuracy,
and the accuracy of both at the steps both evaluated; then the RM's pairs/s, ours and TRL's.

    python bench/real_model_table.py bench/results/real_model_<date>.jsonl [--thresholds 0.3 0.4 0.5] [--plot PNG]

--plot: both learning curves, held-out greedy accuracy against training seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SIDES = {"ours": ("nanochat_ext_grpo", "ours_time_to_accuracy"),
         "TRL": ("trl_real_model_throughput", "trl_time_to_accuracy")}  # side -> (throughput bench, curve bench)
RM = {"ours": "nanochat_ext_rm", "TRL": "trl_real_rm"}  # side -> the RM's bench


def read_results(path: Path) -> list[dict]:
    """A bench's JSON lines; ValueError naming the file (and line) where it is missing or a line is not JSON."""
    if not path.is_file():
        raise ValueError(f"{path}: not found")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    return rows


def last_sitting(rows: list[dict], benches: set[str]) -> list[dict]:
    """The rows of the last sitting that ran any of these benches (bench_real_model.sh tags every row with its
    start time; PARTS runs some parts alone)."""
    sitting = next((r.get("sitting") for r in reversed(rows) if r.get("bench") in benches), None)
    return [r for r in rows if r.get("sitting") == sitting]


def medians(rows: list[dict], benches: dict[str, str], key: str) -> tuple[dict, str]:
    """{side: (median, n) or None} of `key` over each side's rows, and the ours / TRL ratio."""
    values = {side: [r[key] for r in rows if r.get("bench") == bench] for side, bench in benches.items()}
    med = {side: (statistics.median(v), len(v)) if v else None for side, v in values.items()}
    ratio = f"{med['ours'][0] / med['TRL'][0]:.2f}x" if med["ours"] and med["TRL"] else "-"
    return med, ratio


def cell(m: tuple[float, int] | None) -> str:
    return "-" if m is None else f"{m[0]:.2f} (n={m[1]})"


def first_reached(curve: list[dict], threshold: float) -> str:
    """'seconds (step N)' of the first evaluation at or above threshold; '-' where none was."""
    hit = next((r for r in curve if r["greedy_accuracy"] >= threshold), None)
    return "-" if hit is None else f"{hit['train_s']:.1f} s (step {hit['step']})"


def table(all_rows: list[dict], thresholds: list[float]) -> str:
    rows = last_sitting(all_rows, {b for pair in SIDES.values() for b in pair})
    med, ratio = medians(rows, {side: bench for side, (bench, _) in SIDES.items()}, "completions_per_s")
    curves = {side: sorted((r for r in rows if r.get("bench") == bench), key=lambda r: r["step"])
              for side, (_, bench) in SIDES.items()}
    dtype = next((r["dtype"] for r in rows if r.get("bench") == SIDES["ours"][0] and r.get("dtype", "auto") != "auto"),
                 "float32")  # auto: fp32 on CPU
    lines = [f"GRPO throughput (1 prompt x 8 completions x 32 tokens, {dtype}), median over repeats", "",
             "| completions/s | ours | TRL | ours / TRL |", "|---|---|---|---|",
             f"| median | {cell(med['ours'])} | {cell(med['TRL'])} | {ratio} |", "",
             "Time to held-out greedy accuracy (training seconds, evaluations left out)", "",
             "| accuracy reached | ours | TRL |", "|---|---|---|"]
    lines += [f"| >= {t:g} | {first_reached(curves['ours'], t)} | {first_reached(curves['TRL'], t)} |"
              for t in thresholds]
    at = {side: {r["step"]: r for r in curve} for side, curve in curves.items()}
    steps = sorted(set(at["ours"]) & set(at["TRL"]))
    lines += ["", "| step | ours accuracy | TRL accuracy | ours train s | TRL train s |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {at['ours'][s]['greedy_accuracy']:.3f} | {at['TRL'][s]['greedy_accuracy']:.3f} | "
              f"{at['ours'][s]['train_s']:.1f} | {at['TRL'][s]['train_s']:.1f} |" for s in steps]
    rm_rows = last_sitting(all_rows, set(RM.values()))
    rm, rm_ratio = medians(rm_rows, RM, "pairs_per_s")
    dtype = next((r.get("dtype") for r in rm_rows if r.get("bench") == RM["ours"]), None) or "float32"
    if rm["ours"] or rm["TRL"]:
        lines += ["", f"Reward model, full fine-tune on the task's pairs ({dtype}, "
                  "max length 128), median over repeats", "",
                  "| pairs/s | ours | TRL | ours / TRL |", "|---|---|---|---|",
                  f"| median | {cell(rm['ours'])} | {cell(rm['TRL'])} | {rm_ratio} |"]
    return "\n".join(lines)


def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    """Held-out greedy accuracy against training seconds, a line per named curve (rows with train_s and
    greedy_accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for name, curve in curves.items():
        if curve:
            ax.plot([r["train_s"] for r in curve], [r["greedy_accuracy"] for r in curve], marker=".", label=name)
    ax.set_xlabel("training seconds (evaluations left out)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot(all_rows: list[dict], path: Path) -> None:
    rows = last_sitting(all_rows, {b for pair in SIDES.values() for b in pair})
    plot_curves({side: sorted((r for r in rows if r.get("bench") == bench), key=lambda r: r["step"])
                 for side, (_, bench) in SIDES.items()}, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="bench_real_model.sh's JSON lines")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    p.add_argument("--plot", default=None, metavar="PNG", help="write both learning curves there")
    args = p.parse_args(argv)
    try:
        rows = read_results(Path(args.results))
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    print(table(rows, args.thresholds))
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
