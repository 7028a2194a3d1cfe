"""The density experiment's report: does inverse-density weighting give a reward model that is better
on rare prompts and, through GRPO, a policy that is better there and collapses less? And, in its DPO form, does
weighting the pairs help when they train the policy directly?

Reads <root>/seed_<s>/report.json (written by kat_eval for each seed, every arm evaluated on the same
held-out data) and writes <root>/experiment.md, experiment.json and one plot per headline metric.
For each metric and each arm against the uniform one: the per-seed differences, their mean and a 95%
Student-t interval over seeds (paired by seed: the arms share the seed's data, SFT model and prompts),
and the smallest true difference 5% / 80%-power testing could detect with this many seeds.

The regime (speedrun.sh's REGIME, recorded in each seed's report) heads the report, and a table shows
whether GRPO collapsed: each arm's diversity and mode shares beside the SFT policy's. An arm without an
RM of its own (kl_<beta>: the uniform RM with the KL term on) is compared on the policy metrics only. The DPO arms
train the SFT policy on the pairs themselves: dpo (uniform) is compared with GRPO's uniform arm (RM + GRPO against
DPO on the same pairs), dpo_density (each pair weighted as the density RM's) with dpo.

On a real model (EXPERIMENT=density MODEL=smollm2: dpo and dpo_density only) the report also compares accuracy per
kind of question, shows each kind's share of the pairs and mean density weight (from the files each seed's density
stage read and wrote), and each policy's dense-minus-rare gap.

    EXPERIMENT=density SEEDS="0 1 2 3 4" bash speedrun.sh        # runs this at the end
    EXPERIMENT=density REGIME=collapse SEEDS="0 1 2 3 4 5 6 7 8 9" bash speedrun.sh
    EXPERIMENT=density MODEL=smollm2 SEEDS="0 1 2 3 4" bash speedrun.sh
    python -m scripts.kat_experiment_report --root $NANOCHAT_BASE_DIR/experiment --seeds 0 1 2 3 4
        [--arms uniform density]
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from nanochat_ext.cli import parse, parser
from nanochat_ext.data.rows import load_pairs, read_rows
from nanochat_ext.errors import InputError
from nanochat_ext.runtime.session import run_plain
from nanochat_ext.tasks.report import per_topic_rows, save_png, topic_of
from nanochat_ext.tasks.stats import paired_difference

# (metric name, where it comes from, better when higher? None: neither way is better)
RM_GROUPS = ("overall", "dense topics", "rare topics")
RM_METRICS = [(f"rm_{m}_{g.split()[0]}", ("rm", g, m), True) for m in ("accuracy", "margin") for g in RM_GROUPS]
LOWER_IS_BETTER = ("topic_accuracy_spread", "duplicate_share", "mode_share", "top_completion_share")
# A hacked policy scores highest on the RM it hacked, and a gap below zero (rare topics ahead) is no better than one
# above: these two are reported as higher or lower, not better or worse.
NEUTRAL = ("policy_rm_score", "task_accuracy_gap_dense_rare")
POLICY_METRICS = [("policy_rm_score", ("policy", "rm_score_sampled"), None)] + [
    (m, ("policy", m), None if m in NEUTRAL else m not in LOWER_IS_BETTER)
    for m in (*(f"task_accuracy_{how}{where}" for how in ("greedy", "sampled") for where in ("", "_dense", "_rare")),
              "task_accuracy_gap_dense_rare", "topic_accuracy_spread", "distinct_1", "distinct_2",
              "bigram_entropy_bits", "duplicate_share", "mode_share", "top_completion_share")]
HEADLINE = ["rm_accuracy_rare", "task_accuracy_sampled_rare", "distinct_2", "duplicate_share", "mode_share",
            "top_completion_share"]
# a real model's (one sample a question: no diversity to speak of): the rare kinds' gain, the dense kinds' cost
MODEL_HEADLINE = ["task_accuracy_greedy_rare", "task_accuracy_sampled_rare", "task_accuracy_greedy_dense",
                  "task_accuracy_sampled_dense"]
# why each regime of speedrun.sh (REGIME=...) exists, for the report's reader; the settings line says what ran
REGIMES = {"default": "the demo's GRPO settings, where GRPO does not collapse",
           "collapse": "GRPO with a 10x larger step and no KL term (`--lr 1e-3 --beta 0` before GRPO_ARGS), where the "
                       "demo's GRPO collapses onto one answer its RM likes"}
# reward hacking: the RM's score rises while ground-truth accuracy and diversity fall
COLLAPSE = ["rm_score_sampled", "task_accuracy_sampled", "task_accuracy_sampled_rare", "distinct_2",
            "bigram_entropy_bits", "mode_share", "top_completion_share"]


DPO_ARMS = {"dpo": "DPO uniform", "dpo_density": "DPO density"}  # arm -> its policy's name in kat_eval's report
BASELINES = {"dpo_density": "dpo"}  # what an arm is compared with, where not the uniform GRPO arm


def policy_name(arm: str) -> str:
    """The arm's policy in a seed's report (speedrun.sh names them so)."""
    return DPO_ARMS.get(arm, f"GRPO {arm}")


def policy_of(report: dict, arm: str) -> dict:
    """The arm's policy measures in one seed's report; "SFT" is the policy before training, whatever it is ("before
    (SFT)" in the demo, "before (smollm2)" with a real model)."""
    if arm == "SFT":
        return next((p for name, p in report["policies"].items() if name.startswith("before (")), {})
    return report["policies"].get(policy_name(arm), {})


def arm_of(name: str) -> str | None:
    """policy_name's inverse; None for a policy that is no arm."""
    found = [a for a, n in DPO_ARMS.items() if n == name]
    return found[0] if found else name.split(" ", 1)[1] if name.startswith("GRPO ") else None


def baseline(arm: str) -> str:
    return BASELINES.get(arm, "uniform")


def metric_value(report: dict, arm: str, source: tuple) -> float | None:
    """arm's metric in one seed's report; the arm "SFT" is the policy before GRPO."""
    if source[0] == "rm":
        rms = {Path(d).name: r for d, r in report["reward_models"].items()}
        group = rms.get(arm, {}).get(source[1])
        return None if group is None else group[source[2]]
    policy = policy_of(report, arm)
    value = policy.get("task_accuracy_by_topic", {}).get(source[1], {}).get(source[2]) if source[0] == "topic" else \
        policy.get(source[1])
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def topic_metrics(reports: dict[int, dict]) -> list[tuple[str, tuple, bool]]:
    """task_accuracy_<mode>_<kind> for every kind of question the policies were judged on, dense ones first."""
    return [(f"task_accuracy_{mode}_{t}", ("topic", mode, t), True)
            for mode, t, _ in per_topic_rows(next(iter(reports.values()))["policies"])]


def load_reports(root: Path, seeds: list[int]) -> dict[int, dict]:
    reports = {}
    for s in seeds:
        path = root / f"seed_{s}" / "report.json"
        if not path.is_file():
            raise InputError(f"no report for seed {s} (run EXPERIMENT=density SEEDS=... bash speedrun.sh)",
                             path=str(path))
        reports[s] = json.loads(path.read_text())
    return reports


def settings_of(reports: dict[int, dict]) -> dict[str, str]:
    """What speedrun.sh recorded in every seed's report (REGIME, step counts, flags passed through) for the stages it
    ran: the same in every seed that ran the stage (a seed may run fewer arms), or the seeds are not one experiment.
    Reports from before speedrun recorded it: {}."""
    recorded = {s: r.get("stage_args", {}) for s, r in reports.items()}
    settings: dict[str, str] = {}
    first_seed, first = next(iter(recorded.items()))
    for s, other in recorded.items():
        for key in sorted(set(first) & set(other)):
            if (first[key] or None) != (other[key] or None):
                raise InputError(f"the seeds ran with different settings: {key} is {first[key]!r} in seed "
                                 f"{first_seed} and {other[key]!r} in seed {s}")
        settings.update({k: v for k, v in other.items() if v and k not in settings})
    return settings


def analyse(reports: dict[int, dict], arms: list[str], per_kind: bool = False) -> dict:
    """{arm: {metric: {baseline: [...], arm: [...], "diff": PairedDifference fields, "higher_is_better"}}}, the
    baseline uniform (GRPO's) or the arm's own (BASELINES); per_kind: each kind's accuracy too (a real model's task,
    whose kinds are few; the demo's eight topics are compared as its dense and rare groups)."""
    out = {}
    for arm in arms:
        rows = {}
        for name, source, higher in RM_METRICS + POLICY_METRICS + (topic_metrics(reports) if per_kind else []):
            base = [metric_value(r, baseline(arm), source) for r in reports.values()]
            mine = [metric_value(r, arm, source) for r in reports.values()]
            if any(v is None for v in base + mine):
                continue
            d = paired_difference(mine, base)
            rows[name] = {baseline(arm): base, arm: mine, "higher_is_better": higher,
                          "diff": {k: getattr(d, k)
                                   for k in ("diffs", "mean", "low", "high", "half_width", "detectable")}}
        out[arm] = rows
    return out


def verdict(arm: str, rows: dict, headline: list[str] = HEADLINE) -> str:
    """One paragraph from the intervals: what they support, what they cannot tell apart."""
    supported, unresolved = [], []
    for name in headline + [m for m in rows if m not in headline]:
        if name not in rows:
            continue
        d, higher = rows[name]["diff"], rows[name]["higher_is_better"]
        if d["half_width"] == 0:  # the same difference in every seed: no spread, no interval to speak of
            if name in headline:
                unresolved.append(f"{name} (the same difference, {d['mean']:+.3f}, in every seed)")
            continue
        if d["low"] > 0 or d["high"] < 0:
            word = ("higher" if d["mean"] > 0 else "lower") if higher is None else \
                "better" if (d["mean"] > 0) == higher else "worse"
            supported.append(f"{name} {word} by {abs(d['mean']):.3f} [{d['low']:+.3f}, {d['high']:+.3f}]")
        elif name in headline and not math.isnan(d["low"]):
            unresolved.append(f"{name} ({d['mean']:+.3f}, interval [{d['low']:+.3f}, {d['high']:+.3f}], "
                              f"detectable with 80% power: about +-{d['detectable']:.3f})")
    text = f"**{arm} vs {baseline(arm)}.** "
    if not rows:
        return text + "No metric that both arms have in every seed."
    if math.isnan(next(iter(rows.values()))["diff"]["low"]):
        return text + "One seed: differences only, no interval (run at least 2 seeds, 5 for the report)."
    text += ("The intervals exclude zero for: " + "; ".join(supported) + ". ") if supported else \
        "No metric's interval excludes zero. "
    if unresolved:
        text += ("The data do not resolve " + "; ".join(unresolved) + ": a true effect smaller than the "
                 "detectable size would usually go unseen with this many seeds.")
    return text


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def mean_of(reports: dict[int, dict], arm: str, source: tuple) -> float | None:
    values = [metric_value(r, arm, source) for r in reports.values()]
    return None if any(v is None for v in values) else mean(values)


def plot(root: Path, analysis: dict, seeds: list[int], headline: list[str]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name in headline:
        arms = [a for a in analysis if name in analysis[a]]
        if not arms:
            continue
        values = {}  # each arm and baseline's per-seed values, baselines first
        for a in arms:
            values.setdefault(baseline(a), analysis[a][name][baseline(a)])
        values.update({a: analysis[a][name][a] for a in arms})
        labels = list(values)
        fig, ax = plt.subplots(figsize=(3 + len(labels), 3.2))
        for k in range(len(seeds)):  # one line per seed: the pairing
            ax.plot(range(len(labels)), [v[k] for v in values.values()], color="0.75", marker="o", zorder=1)
        for n, a in enumerate(arms):
            d = analysis[a][name]["diff"]
            ax.errorbar(labels.index(a) + 0.12, mean(values[baseline(a)]) + d["mean"], yerr=d["half_width"],
                        color="C3", marker="s", capsize=4, zorder=2,
                        label="baseline mean + mean difference, 95% t interval" if n == 0 else None)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(f"{name} ({len(seeds)} seeds)")
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = root / f"experiment_{name}.png"
        save_png(fig, path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def intro(seeds: list[int], analysis: dict, settings: dict[str, str]) -> list[str]:
    """The report's head: what ran (the regime, or the real model and its task) and how the seeds are compared."""
    regime, model = settings.get("REGIME", "default"), settings.get("MODEL")
    passed = {k: v for k, v in settings.items() if k != "REGIME"}
    shown = " Settings: " + "; ".join(f"{k}=`{v}`" for k, v in passed.items()) + "." if passed else ""
    compared = ("Differences are arm minus its baseline (uniform; dpo for dpo_density) per seed; the interval is the "
                "95% Student-t interval of the mean difference over seeds (paired by seed, n - 1 degrees of freedom). "
                "'detectable' is the smallest true difference a 5%-level test would find with 80% power at this "
                "spread and number of seeds.")
    if model:
        if "density" in analysis:  # the GRPO form: the task's reward, no pairs
            trained = (f"{model} trained by GRPO with its task's reward on skewed questions (two dense kinds, two "
                       "rare), once with every question weighted alike (uniform) and once with each weighted by its "
                       "inverse density in the model's own embeddings (density), on the same questions with the same "
                       "budget and seed.")
        else:
            words = (" in the model's own words (its samples, judged by the task's reward: the best chosen over the "
                     "worst)" if settings.get("OWN_PAIRS") == "1" else "")
            trained = (f"{model} trained by DPO on preference pairs{words} of skewed questions of its task (two dense "
                       "kinds, two rare), once with every pair weighted alike (dpo) and once with each pair weighted "
                       "by its prompt's inverse density in the model's own embeddings (dpo_density), on the same pairs "
                       "with the same budget and seed.")
        return [f"# The density experiment on a real model ({model})", "", trained + shown, "",
                f"Seeds {', '.join(map(str, seeds))}; every seed makes its own training and held-out questions "
                "(balanced across kinds), its pairs where the arms are DPO's, its density weights, and both arms; "
                "every policy and the model before training are evaluated on the same held-out questions, judged by "
                "the task's answer (`--reward_fn last_number`). " + compared, ""]
    return [f"# The density experiment, regime {regime}", "",
            f"Regime `{regime}`: {REGIMES.get(regime, 'not a regime speedrun.sh knows')}." + shown
            + (" A kl_<beta> arm is GRPO against the uniform RM with the KL term on (`--beta <beta>`): a control that "
               "fights collapse by holding the policy near the SFT model instead of changing the RM."
               if any(a.startswith("kl_") for a in analysis) else "")
            + (" A DPO arm trains the SFT policy by DPO on the pairs themselves, no RM (dpo_density: each pair "
               "weighted by its density weight, as the density RM's pairs are); dpo is compared with GRPO's uniform "
               "arm, dpo_density with dpo." if any(a in DPO_ARMS for a in analysis) else ""), "",
            f"Seeds {', '.join(map(str, seeds))}; every seed runs the whole pipeline (its own demo data, SFT model and "
            "density weights), then each arm trains its GRPO policy against its RM (a kl_<beta> arm: the uniform "
            "RM) on the same prompts with the same budget and seed, and every policy is evaluated on the same "
            "held-out prompts. " + compared + " Policy RM scores come from the uniform RM for every arm (one judge); "
            "task accuracy is the demo's ground truth.", ""]


def arm_table(arm: str, rows: dict, headline: list[str]) -> list[str]:
    base = baseline(arm)
    lines = [f"## {arm} minus {base}", "", f"| metric | {base} (mean) | {arm} (mean) | mean diff | 95% interval | "
             "detectable | per seed |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        d = r["diff"]
        label = {True: "", False: " (lower is better)", None: " (neither way is better)"}[r["higher_is_better"]]
        lines.append(f"| {name}{label} | {mean(r[base]):.3f} | {mean(r[arm]):.3f} | {d['mean']:+.3f} | "
                     f"[{d['low']:+.3f}, {d['high']:+.3f}] | {d['detectable']:.3f} | "
                     f"{', '.join(f'{x:+.3f}' for x in d['diffs'])} |")
    return lines + ["", verdict(arm, rows, headline), ""]


def seed_weights(report: dict) -> dict[str, tuple[float, float]] | None:
    """One seed's {topic (or kind): (its share of the pairs, its pairs' mean density weight)}: as the seed's report
    keeps them (`density_weights`: where its pairs and weights are not kept beside it, docs/density_experiment/), else
    from the pairs and weights its density stage read and wrote (its command in the report, its paths as it ran).
    None where it ran none, or its files are gone (the report rebuilt elsewhere from the seeds' report.json alone)."""
    if "density_weights" in report:
        return {t: tuple(v) for t, v in report["density_weights"].items()}
    command = report.get("stages", {}).get("density")
    if not command:
        return None
    words = shlex.split(command)
    pairs, weights = (Path(words[words.index(flag) + 1]) for flag in ("--pairs", "--out"))
    if not (pairs.is_file() and weights.is_file()):  # absolute, or relative to where speedrun.sh ran (here)
        return None
    weight = {w["prefix_id"]: w["weight"] for w in map(json.loads, weights.read_text().splitlines())}
    topic = {n: topic_of(row) for n, row in read_rows(str(pairs))}
    rows = [(topic.get(r.line), weight[r.prefix_id]) for r in load_pairs(pairs)[0]]
    by_topic = {t: [w for topic, w in rows if topic == t] for t in {t for t, _ in rows if t is not None}}
    return {t: (len(mine) / len(rows), mean(mine)) for t, mine in by_topic.items()}


def weights_by_topic(reports: dict[int, dict]) -> dict[str, dict[str, list[float | None]]]:
    """{topic (or kind): {"share": [per seed], "weight": [per seed]}} (seed_weights); a topic with no pair in a seed
    has share 0 and weight None there. {} where a seed has none."""
    seen = [seed_weights(r) for r in reports.values()]
    if any(seed is None for seed in seen):
        return {}
    return {t: {"share": [seed.get(t, (0.0, None))[0] for seed in seen],
                "weight": [seed.get(t, (0.0, None))[1] for seed in seen]}
            for t in sorted({t for seed in seen for t in seed})}


def weights_section(by_topic: dict[str, dict[str, list[float | None]]]) -> list[str]:
    if not by_topic:
        return []
    ranked = sorted(by_topic, key=lambda t: -mean(by_topic[t]["share"]))
    return ["## Do the density weights find the rare kinds?", "",
            "Each kind's (topic's) share of the training pairs and its pairs' mean density weight (the weights have "
            "mean 1 over prompts), mean over seeds and per seed ('-': no pair of the kind in that seed; its mean "
            "weight is over the seeds that have one). Weighting can only help the rare kinds if it weighs them up.",
            "", "| kind | share of pairs | mean weight | per seed |", "|---|---|---|---|"] + [
        f"| {t} | {mean(by_topic[t]['share']):.3f} | {mean([w for w in by_topic[t]['weight'] if w is not None]):.3f} "
        f"| {', '.join('-' if w is None else f'{w:.3f}' for w in by_topic[t]['weight'])} |" for t in ranked] + [""]


def uniform_rm_gaps(reports: dict[int, dict]) -> list[float]:
    """The uniform RM's held-out accuracy on dense minus rare topics per seed (NaN where a seed has none)."""
    return [next((v["dense topics"]["accuracy"] - v["rare topics"]["accuracy"]
                  for d, v in r["reward_models"].items() if Path(d).name == "uniform" and "rare topics" in v), math.nan)
            for r in reports.values()]


def effect_section(reports: dict[int, dict], analysis: dict) -> list[str]:
    """Whether the baseline leaves weighting anything to fix: the uniform RM's (demo) or the baseline policy's (a real
    model) accuracy on dense minus rare prompts, per seed."""
    rm_gaps = uniform_rm_gaps(reports)
    if not all(math.isnan(g) for g in rm_gaps):
        return ["## Can the demo show an effect?", "",
                "A uniform RM has to be measurably worse on rare topics than on dense ones, or weighting has nothing "
                "to fix. Uniform RM accuracy, dense minus rare topics, per seed: "
                f"{', '.join(f'{g:+.3f}' for g in rm_gaps)}.",
                ""]
    lines = ["## Can the model show an effect?", "",
             "Weighting has something to fix only where training leaves the rare kinds behind. Sampled accuracy, "
             "dense minus rare kinds, per seed:", ""]
    for arm in dict.fromkeys(["SFT", *map(baseline, analysis), *analysis]):
        gaps = [metric_value(r, arm, ("policy", "task_accuracy_gap_dense_rare")) for r in reports.values()]
        if all(g is not None for g in gaps):
            lines.append(f"- {'before training' if arm == 'SFT' else arm}: {', '.join(f'{g:+.3f}' for g in gaps)}")
    return lines + [""]


def collapse_section(reports: dict[int, dict], analysis: dict, before: str = "SFT") -> tuple[list[str], dict]:
    """Each policy's diversity and reward-hacking measures, mean over seeds, beside the policy before training (named
    `before` in the table: "SFT" in the demo)."""
    means = {arm: {name: mean_of(reports, arm, ("policy", name)) for name in COLLAPSE}
             for arm in dict.fromkeys(["SFT", "uniform", *map(baseline, analysis), *analysis])}
    means = {arm: m for arm, m in means.items() if any(v is not None for v in m.values())}
    lines = ["## Does training collapse here?", "",
             f"Mean over seeds of each policy's measures on held-out prompts ({before}: the policy before training; an "
             "RM score, where there are RMs, from the uniform RM). Reward hacking: the RM's score rises while task "
             "accuracy and diversity fall. Collapse: one answer for every prompt (mode and top completion shares).",
             "", "| metric | " + " | ".join(before if a == "SFT" else a for a in means) + " |",
             "|---|" + "---|" * len(means)]
    lines += [f"| {name} | " + " | ".join("-" if m[name] is None else f"{m[name]:.3f}" for m in means.values()) + " |"
              for name in COLLAPSE if any(m[name] is not None for m in means.values())] + [""]
    return lines, means


def write(root: Path, seeds: list[int], analysis: dict, reports: dict[int, dict], settings: dict[str, str]) -> Path:
    by_topic = weights_by_topic(reports)
    headline = MODEL_HEADLINE if settings.get("MODEL") else HEADLINE
    lines = intro(seeds, analysis, settings)
    for arm, rows in analysis.items():
        lines += arm_table(arm, rows, headline)
    lines += weights_section(by_topic) + effect_section(reports, analysis)
    collapse, means = collapse_section(reports, analysis, "before" if settings.get("MODEL") else "SFT")
    plots = plot(root, analysis, seeds, headline)
    lines += collapse + ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    md = root / "experiment.md"
    md.write_text("\n".join(lines))
    (root / "experiment.json").write_text(json.dumps({
        "seeds": seeds, "regime": settings.get("REGIME", "default"), "model": settings.get("MODEL"), "arms": analysis,
        "policy_means": means, "weights_by_topic": by_topic,
        "uniform_rm_dense_minus_rare": [None if math.isnan(g) else g for g in uniform_rm_gaps(reports)]}, indent=1))
    return md


def flags() -> argparse.ArgumentParser:
    p = parser("kat_experiment_report", __doc__)
    p.add_argument("--root", required=True, help="the experiment dir holding seed_<s>/report.json")
    p.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds whose reports are compared")
    p.add_argument("--arms", nargs="+", default=None,
                   help="the GRPO arms to compare with uniform (default: every arm in every seed's report)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse(flags(), argv)
    return run_plain(lambda: report(Path(args.root), args.seeds, args.arms), "experiment")


def report(root: Path, seeds: list[int], arms: list[str] | None = None) -> Path:
    reports = load_reports(root, seeds)
    settings = settings_of(reports)  # one experiment, or stop before any arithmetic
    present = [{arm_of(name) for name in r["policies"]} - {None} for r in reports.values()]
    everywhere, anywhere = set.intersection(*present), set.union(*present)
    if arms:  # an arm given as another's baseline (dpo beside dpo_density) is compared itself where its own ran
        given = [a for a in arms if a != "uniform"]
        arms = [a for a in given if a not in map(baseline, given) or baseline(a) in anywhere]
    else:
        arms = sorted(a for a in everywhere - {"uniform"} if baseline(a) in everywhere)
    for arm in dict.fromkeys([*map(baseline, arms), *arms]):  # each arm and what it is compared with
        missing = [s for s, names in zip(reports, present) if arm not in names]
        if missing:
            raise InputError(f"seed {missing[0]}'s report has no policy '{policy_name(arm)}'",
                             path=str(root / f"seed_{missing[0]}" / "report.json"))
    if not arms:
        raise InputError("no arm with its baseline in the reports (ARMS=\"uniform density\")", path=str(root))
    return write(root, seeds, analyse(reports, arms, per_kind=bool(settings.get("MODEL"))), reports, settings)


if __name__ == "__main__":
    sys.exit(main())
