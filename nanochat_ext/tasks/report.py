"""kat_eval's report: the reward models measured on held-out pairs by topic (dense and rare), report.md's tables of
them and of the policies' measures, and the training curves each stage logged.
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from nanochat_ext.data.rows import PairRow, read_rows
from nanochat_ext.ddp_common import DistEnv, gather_objects, print0
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.reward_model import load_reward_model

# stage dir -> (plot name prefix, the metrics it plots); GRPO writes nanochat's chatrl_checkpoints/
PLOT_KEYS = {"chatsft_checkpoints": ("chatsft", ["train/loss"]), "rm_checkpoints": ("rm", ["train/accuracy", "val/accuracy"]),
             "chatrl_checkpoints": ("grpo", ["train/reward", "eval/reward_sampled"])}



def topics_of(path: str) -> dict[int, str]:
    """row number (a JSONL line, a table's row) -> "topic" field, for rows that have one."""
    return {n: row["topic"] for n, row in read_rows(path) if isinstance(row.get("topic"), str)}


def dense_topics(counts: Counter) -> set[str]:
    return {t for t, c in counts.items() if c >= sum(counts.values()) / len(counts)}


def eval_rm(rm_dir: str, pairs: list[PairRow], topics: dict[int, str], env: DistEnv, rm_backbone: str | None,
            compile_flag: str) -> dict:
    """Collective: an RM's accuracy and mean margin on held-out pairs, overall, per topic, dense and rare topics."""
    scorer = load_reward_model(rm_dir, env.device, backbone=rm_backbone)
    print0(compile_models(compile_flag, env.device, scorer.model.backbone))
    mine = pairs[env.rank::env.world_size]
    prompts = [r.prompt for r in mine]
    margins = [c - r for c, r in zip(scorer.score(prompts, [r.chosen for r in mine]),
                                      scorer.score(prompts, [r.rejected for r in mine]))]
    rows = [(topics.get(r.line, "all"), m) for r, m in zip(mine, margins)]
    rows = [x for part in gather_objects(rows) for x in part]
    groups: dict[str, list[float]] = defaultdict(list)
    for topic, m in rows:
        groups[topic].append(m)
    dense = dense_topics(Counter(t for t, _ in rows)) if topics else set()
    if topics:
        groups["dense topics"] = [m for t, m in rows if t in dense]
        groups["rare topics"] = [m for t, m in rows if t not in dense]
    groups["overall"] = [m for _, m in rows]
    return {g: {"n": len(v), "accuracy": sum(m > 0 for m in v) / len(v), "margin": sum(v) / len(v)}
            for g, v in groups.items() if v}



def plot_curves(base: Path, out_dir: Path, task: str | None = None, start: dict | None = None) -> list[tuple[str, Path]]:
    """One PNG per training stage that logged metrics.jsonl; for a GRPO run that evaluated the task reward `task`
    on held-out prompts, also its learning curve against training seconds (perf/train_time_s, evaluations left
    out), from the policy before training at 0 s (start: its task accuracy, greedy and sampled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, ax, name: str, xlabel: str) -> None:
        ax.set_xlabel(xlabel)
        ax.set_title(name)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        plots.append((name, path))

    plots = []
    for stage_dir, (prefix, keys) in PLOT_KEYS.items():
        for run in sorted((base / stage_dir).glob("*/logs/metrics.jsonl")):
            rows = [json.loads(line) for line in run.read_text().splitlines()]
            name = f"{prefix}_{run.parent.parent.name}"
            fig, ax = plt.subplots(figsize=(5, 3))
            for key in keys:
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, label=key)
            save(fig, ax, name, "step")
            seconds = {r["step"]: r["perf/train_time_s"] for r in rows if "perf/train_time_s" in r}
            curves = {mode: [(seconds[r["step"]], r[f"eval/{task}_{mode}"]) for r in rows
                             if f"eval/{task}_{mode}" in r and r["step"] in seconds] for mode in ("greedy", "sampled")}
            if stage_dir == "chatrl_checkpoints" and task and any(curves.values()):
                fig, ax = plt.subplots(figsize=(5, 3))
                for mode, pts in curves.items():
                    if start and start.get(mode) is not None:
                        pts = [(0.0, start[mode])] + pts
                    ax.plot(*zip(*pts), marker=".", label=f"held-out {task}, {mode}")
                save(fig, ax, f"{name}_accuracy_vs_time", "training seconds (evaluations left out)")
    return plots


def fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}" if isinstance(x, float) else str(x)


def write_report(base_dir: str, rms: dict, policies: dict, timings: list[tuple[str, float]], plots,
                 stage_args: dict[str, str] | None, *, pass_k: int, samples: int, temperature: float, score_rm: str,
                 tool_prompts: str) -> str:
    """report.md: wall time per stage, the RMs' and the policies' tables, tool use, example completions, curves."""
    lines = ["# nanochat_ext report", "", f"Artifacts: `{base_dir}`", ""]
    passed = {k: v for k, v in (stage_args or {}).items() if v}
    if passed:  # speedrun.sh's regime and the flags it passed through to the stages
        lines += ["Settings of this run: " + "; ".join(f"{k}=`{v}`" for k, v in passed.items()), ""]
    if timings:
        lines += ["## Wall time per stage", "", "| stage | seconds |", "|---|---|"]
        lines += [f"| {name} | {sec:.0f} |" for name, sec in timings] + [f"| total | {sum(s for _, s in timings):.0f} |", ""]
    if rms:
        groups = sorted({g for r in rms.values() for g in r}, key=lambda g: (g != "overall", "topics" not in g, g))
        lines += ["## Reward models on held-out pairs", "", "accuracy (mean margin), by group", "",
                  "| group | n | " + " | ".join(Path(d).name for d in rms) + " |", "|---|---|" + "---|" * len(rms)]
        for g in groups:
            n = next(r[g]["n"] for r in rms.values() if g in r)
            cells = [f"{r[g]['accuracy']:.3f} ({r[g]['margin']:.2f})" if g in r else "-" for r in rms.values()]
            lines.append(f"| {g} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    if policies:
        keys = ["rm_score_greedy", "rm_score_sampled", "task_accuracy_greedy", "task_accuracy_sampled",
                "task_accuracy_sampled_dense", "task_accuracy_sampled_rare", "task_accuracy_gap_dense_rare",
                "topic_accuracy_spread", "distinct_1", "distinct_2", "duplicate_share", "mode_share",
                "top_completion_share", "bigram_entropy_bits", "completion_len"]
        keys += [f"pass@{j}{suffix}" for suffix in ("", "_unbiased") for j in range(1, pass_k + 1)]
        lines += ["## Policy before and after GRPO on held-out prompts", "",
                  f"greedy: one completion per prompt; sampled: {samples} per prompt at temperature "
                  f"{temperature}; RM score from `{Path(score_rm).name}`", "",
                  "| metric | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
        lines += [f"| {k} | " + " | ".join(fmt(p[k]) for p in policies.values()) + " |" for k in keys]
        lines.append("")
        uses = {name: p["tool_use"] for name, p in policies.items() if p.get("tool_use")}
        if uses:
            lines += [f"## Tool use on `{Path(tool_prompts).name}`", "",
                      "greedy task accuracy with nanochat's calculator running inside the completions and with "
                      "`--tools none`; calls per completion; the share of calls it refused; pass@k with tools", "",
                      "| metric | " + " | ".join(uses) + " |", "|---|" + "---|" * len(uses)]
            lines += [f"| {k} | " + " | ".join(fmt(u.get(k)) for u in uses.values()) + " |"
                      for k in next(iter(uses.values()))]
            lines.append("")
        for name, p in policies.items():
            lines += [f"Greedy completions of the first held-out prompts, {name} (`{p['checkpoint']}`):", ""]
            lines += [f"- {e['prompt']!r} -> {e['completion']!r}" for e in p["examples"]] + [""]
    if plots:
        lines += ["## Training curves", ""] + [f"![{name}]({path.name})" for name, path in plots] + [""]
    return "\n".join(lines)
