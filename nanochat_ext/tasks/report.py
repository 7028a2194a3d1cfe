"""kat_eval's report: the reward models measured on held-out pairs by topic (dense and rare), report.md's tables of
them and of the policies' measures, and the training curves each stage logged.
"""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

from nanochat_ext.data.rows import PairRow, PromptRow, read_rows
from nanochat_ext.ddp_common import DistEnv, gather_objects, print0
from nanochat_ext.models.compiled import compile_models
from nanochat_ext.models.reward_model import load_reward_model
from nanochat_ext.tasks import synthetic
from nanochat_ext.tasks.stats import sample_diversity

# stage dir -> (plot name prefix, the metrics it plots); GRPO writes nanochat's chatrl_checkpoints/
PLOT_KEYS = {"chatsft_checkpoints": ("chatsft", ["train/loss"]),
             "rm_checkpoints": ("rm", ["train/accuracy", "val/accuracy"]),
             "chatrl_checkpoints": ("grpo", ["train/reward", "eval/reward_sampled"])}



def topics_of(path: str) -> dict[int, str]:
    """row number (a JSONL line, a table's row) -> "topic" field, for rows that have one."""
    return {n: row["topic"] for n, row in read_rows(path) if isinstance(row.get("topic"), str)}


def topic_of(row: dict) -> str | None:
    """A row's group for the report: the demo's "topic", else a task's "kind" (word_arithmetic's)."""
    group = row.get("topic", row.get("kind"))
    return group if isinstance(group, str) else None


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



def save_png(fig, path: Path, dpi: int) -> None:
    """A plot as a PNG of 128 colours (pillow, matplotlib's own dependency): a plot's lines and text look the same at
    about a third of the bytes, which matters for the figures docs/ keeps."""
    from PIL import Image  # with matplotlib: imported when a report plots, not when the package loads

    fig.savefig(path, dpi=dpi)
    Image.open(path).convert("RGB").quantize(128, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, "PNG", optimize=True)


def plot_curves(base: Path, out_dir: Path, task: str | None = None,
                start: dict | None = None) -> list[tuple[str, Path]]:
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
        save_png(fig, path, dpi=80)
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
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def write_report(base_dir: str, rms: dict, policies: dict, timings: list[tuple[str, float]], plots,
                 stage_args: dict[str, str] | None, stages: list[tuple[str, str]], *, pass_k: int, samples: int,
                 temperature: float, score_rm: str, tool_prompts: str, holdout: float | None) -> str:
    """report.md: wall time per stage, the RMs' and the policies' tables, tool use, example completions, curves, and
    the command each stage ran (speedrun.sh's stages.tsv)."""
    lines = ["# nanochat_ext report", "", f"Artifacts: `{base_dir}`", ""]
    held_out = "held-out" if holdout is None else \
        f"held-out (the {holdout:.0%} of the training files' prompts, by prefix_id, the trainers held out)"
    passed = {k: v for k, v in (stage_args or {}).items() if v}
    if passed:  # speedrun.sh's regime and the flags it passed through to the stages
        lines += ["Settings of this run: " + "; ".join(f"{k}=`{v}`" for k, v in passed.items()), ""]
    if timings:
        lines += ["## Wall time per stage", "", "| stage | seconds |", "|---|---|"]
        lines += [f"| {name} | {sec:.0f} |" for name, sec in timings]
        lines += [f"| total | {sum(s for _, s in timings):.0f} |", ""]
    if rms:
        groups = sorted({g for r in rms.values() for g in r}, key=lambda g: (g != "overall", "topics" not in g, g))
        lines += [f"## Reward models on {held_out} pairs", "", "accuracy (mean margin), by group", "",
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
        lines += [f"## Policies on {held_out} prompts", "",
                  f"greedy: one completion per prompt; sampled: {samples} per prompt at temperature "
                  f"{temperature}; RM score from `{Path(score_rm).name}`", "",
                  "| metric | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
        lines += [f"| {k} | " + " | ".join(fmt(p[k]) for p in policies.values()) + " |" for k in keys]
        lines += [f"| task_accuracy_{mode} {topic}{label} | " + " | ".join(
                  fmt(p.get("task_accuracy_by_topic", {}).get(mode, {}).get(topic)) for p in policies.values()) + " |"
                  for mode, topic, label in per_topic_rows(policies)]
        lines.append("")
        uses = {name: p["tool_use"] for name, p in policies.items() if p.get("tool_use")}
        if uses:
            lines += [f"## Tool use on `{Path(tool_prompts).name}`", "",
                      "greedy task accuracy with the policy's tools running in its completions (`--tools`: "
                      "nanochat's calculator by default) and with them switched off (the same prompts, a call left "
                      "unanswered); calls per completion; the share "
                      "of calls that failed or were refused; pass@k with tools", "",
                      "| metric | " + " | ".join(uses) + " |", "|---|" + "---|" * len(uses)]
            lines += [f"| {k} | " + " | ".join(fmt(u.get(k)) for u in uses.values()) + " |"
                      for k in next(iter(uses.values()))]
            lines.append("")
        for name, p in policies.items():
            lines += [f"Greedy completions of the first held-out prompts, {name} (`{p['checkpoint']}`; the last "
                      f"assistant turn, what the rewards read):", ""]
            lines += [f"- {e['prompt']!r} -> {e['completion']!r}" for e in p["examples"]] + [""]
    if plots:
        lines += ["## Training curves", ""] + [f"![{name}]({path.name})" for name, path in plots] + [""]
    if stages:
        lines += ["## Stages and the flags they ran with", ""] + [f"- {name}: `{cmd}`" for name, cmd in stages] + [""]
    return "\n".join(lines)


def per_topic_rows(policies: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(mode, topic, " (dense)", " (rare)" or "") for the per-topic rows: every topic (or kind) the policies were
    judged on, dense ones first."""
    first = next((p for p in policies.values() if p.get("task_accuracy_by_topic")), {})
    dense = first.get("dense_topics")
    topics = sorted(first.get("task_accuracy_by_topic", {}).get("sampled", {}),
                    key=lambda t: (t not in (dense or []), t))
    label = (lambda t: "") if dense is None else (lambda t: " (dense)" if t in dense else " (rare)")
    return [(mode, t, label(t)) for mode in ("greedy", "sampled") for t in topics]


def all_judgeable(rows: list[PromptRow]) -> bool:
    """Whether every prompt is one of the demo's, whose completions its ground truth judges (synthetic.judge)."""
    return all(r.row.get("topic") in synthetic.TOPIC_WORDS for r in rows)


Completion = tuple[int, str, float, int]  # (prompt index, text, RM score, tokens)


class Judged:
    """Task accuracy of a policy's completions by mode (greedy, sampled): the demo's ground truth where every prompt
    is the demo's, else the task reward's verdicts (which have no topics); dense and rare topics told apart by their
    share of the prompts."""

    def __init__(self, rows: list[PromptRow], completions: dict[str, list[Completion]],
                 verdicts: dict[str, list[bool]]):
        self.topic_of = [topic_of(r.row) for r in rows]
        self.judgeable, self.completions, self.verdicts = all_judgeable(rows), completions, verdicts
        shares = {topic_of(r.row): r.row["share"] for r in rows if isinstance(r.row.get("share"), (int, float))}
        counts = Counter(t for t in self.topic_of if t is not None)
        # dense: at least the mean share of the training rows where the rows say it (a held-out set balanced across
        # kinds, as the density experiment's), else of these rows (the demo's held-out prompts keep its skew); rows
        # spread evenly over their kinds with no shares (word_arithmetic's) have no dense and rare ones
        self.split = bool(shares) or len(set(counts.values())) > 1
        self.dense = {t for t, s in shares.items() if s >= sum(shares.values()) / len(shares)} if shares else \
            dense_topics(counts) if self.split else set()

    def accuracy(self, mode: str, topics: Callable[[str], bool] | None = None) -> float | None:
        """Of the mode's completions whose prompt's topic passes `topics` (None: all); None where nothing judges."""
        items = self.completions[mode]
        verdicts = [synthetic.judge(self.topic_of[i], text) for i, text, _, _ in items] if self.judgeable else \
            self.verdicts.get(mode, [])
        marks = [v for (i, *_), v in zip(items, verdicts)
                 if topics is None or (self.topic_of[i] is not None and topics(self.topic_of[i]))]
        return sum(marks) / len(marks) if marks else None

    def topics(self) -> list[str]:
        return sorted({t for t in self.topic_of if t is not None})

    def by_group(self) -> dict[str, float | None]:
        """task_accuracy_<mode>, and its dense and rare topics'."""
        groups = (("", None), ("_dense", lambda t: t in self.dense), ("_rare", lambda t: t not in self.dense))
        return {f"task_accuracy_{mode}{suffix}": self.accuracy(mode, topics) if self.split or not suffix else None
                for mode in self.completions for suffix, topics in groups}

    def per_topic(self, mode: str) -> dict[str, float | None]:
        return {t: self.accuracy(mode, lambda topic, t=t: topic == t) for t in self.topics()}

    def topic_spread(self) -> float | None:
        """The standard deviation of the sampled completions' accuracy over the prompts' topics (or kinds)."""
        per_topic = [a for a in self.per_topic("sampled").values() if a is not None]
        if not per_topic:
            return None
        mean = sum(per_topic) / len(per_topic)
        return (sum((a - mean) ** 2 for a in per_topic) / len(per_topic)) ** 0.5


def policy_measures(source: str, rows: list[PromptRow], greedy: list[Completion], sampled: list[Completion],
                    verdicts: dict[str, list[bool]], passes: dict, tool_use: dict) -> dict:
    """A policy's row of the report: RM scores, task accuracy (overall, dense and rare topics, their gap and the spread
    over topics), the sampled completions' diversity, length, pass@k, tool use and four greedy examples."""
    judged = Judged(rows, {"greedy": greedy, "sampled": sampled}, verdicts)
    accuracy = judged.by_group()
    dense, rare = accuracy["task_accuracy_sampled_dense"], accuracy["task_accuracy_sampled_rare"]
    texts_by_prompt = defaultdict(list)
    for i, text, _, _ in sampled:
        texts_by_prompt[i].append(text)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"checkpoint": source, "rm_score_greedy": mean([s for _, _, s, _ in greedy]),
            "rm_score_sampled": mean([s for _, _, s, _ in sampled]), **accuracy,
            "task_accuracy_gap_dense_rare": None if dense is None or rare is None else dense - rare,
            "topic_accuracy_spread": judged.topic_spread(),
            "task_accuracy_by_topic": {mode: judged.per_topic(mode) for mode in ("greedy", "sampled")},
            "dense_topics": sorted(judged.dense) if judged.split else None,
            **sample_diversity(list(texts_by_prompt.values())), "completion_len": mean([n for *_, n in sampled]),
            **{k.removeprefix("eval/"): v for k, v in passes.items()}, "tool_use": tool_use,
            "examples": [{"prompt": rows[i].messages[-1]["content"], "completion": text}
                         for i, text, _, _ in sorted(greedy, key=lambda item: item[0])[:4]]}
