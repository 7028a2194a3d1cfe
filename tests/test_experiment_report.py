"""kat_experiment_report on hand-made per-seed reports: paired differences, intervals, the verdict."""
import json
import math
import shutil

from conftest import REPO

from nanochat_ext.data.rows import PromptRow, load_pairs, prefix_id_of, read_rows
from nanochat_ext.tasks import synthetic
from nanochat_ext.tasks.report import policy_measures
from nanochat_ext.tasks.synthetic import write_jsonl
from nanochat_ext.tasks.word_arithmetic import make_skewed_pairs, make_skewed_questions
from scripts import kat_experiment_report


def fake_report(seed: int, rare_uniform: float, rare_density: float) -> dict:
    def rm(rare):
        return {g: {"n": 10, "accuracy": a, "margin": 1.0} for g, a in
                (("overall", 0.8), ("dense topics", 0.9), ("rare topics", rare))}

    policy = {"rm_score_sampled": 0.1 * seed, "task_accuracy_sampled_rare": 0.5, "distinct_2": 0.9,
              "duplicate_share": 0.1}
    return {"reward_models": {"/x/rm_checkpoints/uniform": rm(rare_uniform),
                              "/x/rm_checkpoints/density": rm(rare_density)},
            "policies": {"GRPO uniform": policy, "GRPO density": {**policy, "distinct_2": 0.9 + 0.01 * seed}}}


def test_report_pairs_seeds_and_says_what_is_resolved(tmp_path):
    rare = {0: (0.50, 0.60), 1: (0.55, 0.62), 2: (0.40, 0.52), 3: (0.45, 0.50), 4: (0.50, 0.61)}
    for s, (u, d) in rare.items():
        (tmp_path / f"seed_{s}").mkdir()
        (tmp_path / f"seed_{s}" / "report.json").write_text(json.dumps(fake_report(s, u, d)))
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1", "2", "3", "4"]) == 0
    out = json.loads((tmp_path / "experiment.json").read_text())
    d = out["arms"]["density"]["rm_accuracy_rare"]["diff"]
    assert [round(x, 3) for x in d["diffs"]] == [0.1, 0.07, 0.12, 0.05, 0.11]
    assert abs(d["mean"] - 0.09) < 1e-9 and 0 < d["low"] < 0.09 < d["high"]
    md = (tmp_path / "experiment.md").read_text()
    assert "The intervals exclude zero for: rm_accuracy_rare better by 0.090" in md
    assert "task_accuracy_sampled_rare (the same difference, +0.000, in every seed)" in md
    assert [round(g, 2) for g in out["uniform_rm_dense_minus_rare"]] == [0.4, 0.35, 0.5, 0.45, 0.4]
    assert (tmp_path / "experiment_rm_accuracy_rare.png").is_file()
    assert out["regime"] == "default" and md.startswith("# The density experiment, regime default")  # no stage_args
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "9"]) == 2  # seed 9 has no report


def test_report_names_the_regime_and_compares_a_kl_arm_on_its_policy(tmp_path, capsys):
    """The collapse regime's report: the regime from the seeds' reports, the reward-hacking measures with
    intervals, an arm with no RM of its own (kl) compared on policy metrics, the collapse table beside SFT."""
    def seed_report(seed: int, regime: str = "collapse") -> dict:
        r = fake_report(seed, 0.5, 0.6)
        hacked = {"mode_share": 0.9 - 0.01 * seed, "top_completion_share": 0.6, "distinct_2": 0.2,
                  "task_accuracy_gap_dense_rare": 0.5, "rm_score_sampled": 3.0}
        r["policies"] = {"before (SFT)": {"mode_share": 0.25, "top_completion_share": 0.01, "distinct_2": 0.95},
                         "GRPO uniform": hacked, "GRPO density": {**hacked, "mode_share": 0.8},
                         "GRPO kl_0.1": {**hacked, "mode_share": 0.3 + 0.02 * seed, "distinct_2": 0.9}}
        r["stage_args"] = {"REGIME": regime, "SFT_ARGS": "", "GRPO_ARGS": "--top_k 5"}
        return r

    for s in (0, 1):
        (tmp_path / f"seed_{s}").mkdir()
        (tmp_path / f"seed_{s}" / "report.json").write_text(json.dumps(seed_report(s)))
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1", "--arms", "uniform", "density",
                                       "kl_0.1"]) == 0
    out = json.loads((tmp_path / "experiment.json").read_text())
    assert out["regime"] == "collapse" and set(out["arms"]) == {"density", "kl_0.1"}
    kl = out["arms"]["kl_0.1"]
    assert not any(name.startswith("rm_") for name in kl)  # no RM of its own
    assert [round(x, 3) for x in kl["mode_share"]["diff"]["diffs"]] == [-0.6, -0.57]
    assert kl["mode_share"]["higher_is_better"] is False and kl["distinct_2"]["higher_is_better"] is True
    assert kl["policy_rm_score"]["higher_is_better"] is None  # a hacked policy scores highest on the RM it hacked
    assert [round(x, 3) for x in out["arms"]["density"]["mode_share"]["diff"]["diffs"]] == [-0.1, -0.09]
    assert out["policy_means"]["SFT"]["mode_share"] == 0.25 and out["policy_means"]["uniform"]["distinct_2"] == 0.2
    md = (tmp_path / "experiment.md").read_text()
    assert md.startswith("# The density experiment, regime collapse") and "GRPO_ARGS=`--top_k 5`" in md
    assert "## Does training collapse here?" in md and "| mode_share | 0.250 | 0.895 | 0.800 | 0.310 |" in md
    assert "mode_share (lower is better)" in md and "top_completion_share (lower is better)" in md
    assert (tmp_path / "experiment_mode_share.png").is_file()

    # only the arms asked for, and each must be in every seed's report
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1",
                                       "--arms", "uniform", "kl_0.1"]) == 0
    assert set(json.loads((tmp_path / "experiment.json").read_text())["arms"]) == {"kl_0.1"}
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1",
                                       "--arms", "uniform", "kl_0.2"]) == 2
    assert "policy_rm_score (neither way is better)" in (tmp_path / "experiment.md").read_text()
    # every seed needs the uniform arm, which every arm is compared with
    no_uniform = seed_report(1)
    del no_uniform["policies"]["GRPO uniform"]
    (tmp_path / "seed_1" / "report.json").write_text(json.dumps(no_uniform))
    capsys.readouterr()
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1", "--arms", "kl_0.1"]) == 2
    assert "seed 1's report has no policy 'GRPO uniform'" in capsys.readouterr().err
    # seeds run in different regimes, or with other settings, do not make one report
    (tmp_path / "seed_1" / "report.json").write_text(json.dumps(seed_report(1, regime="default")))
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1"]) == 2
    assert "different settings: REGIME is 'collapse' in seed 0 and 'default' in seed 1" in capsys.readouterr().err


def test_dpo_arms_compare_dpo_with_grpo_and_weighted_dpo_with_dpo(tmp_path, capsys):
    """The DPO form of the question: dpo_density against uniform DPO, dpo against RM + GRPO (uniform), on policy
    metrics only (no RM of their own); a seed without the uniform DPO policy cannot answer it."""
    for s in range(3):
        report = fake_report(s, 0.5, 0.6)
        base = report["policies"]["GRPO uniform"]
        report["policies"]["DPO uniform"] = {**base, "task_accuracy_sampled_rare": 0.4}
        report["policies"]["DPO density"] = {**base, "task_accuracy_sampled_rare": 0.45 + 0.01 * s}
        (tmp_path / f"seed_{s}").mkdir()
        (tmp_path / f"seed_{s}" / "report.json").write_text(json.dumps(report))
    args = ["--root", str(tmp_path), "--seeds", "0", "1", "2", "--arms", "uniform", "dpo", "dpo_density"]
    assert kat_experiment_report.main(args) == 0
    out = json.loads((tmp_path / "experiment.json").read_text())
    rows = out["arms"]["dpo_density"]["task_accuracy_sampled_rare"]
    assert rows["dpo"] == [0.4] * 3 and [round(d, 3) for d in rows["diff"]["diffs"]] == [0.05, 0.06, 0.07]
    assert [round(d, 3) for d in out["arms"]["dpo"]["task_accuracy_sampled_rare"]["diff"]["diffs"]] == [-0.1] * 3
    assert not any(name.startswith("rm_") for name in out["arms"]["dpo_density"])
    md = (tmp_path / "experiment.md").read_text()
    assert "## dpo_density minus dpo" in md and "## dpo minus uniform" in md and "**dpo_density vs dpo.**" in md
    report = json.loads((tmp_path / "seed_1" / "report.json").read_text())
    del report["policies"]["DPO uniform"]
    (tmp_path / "seed_1" / "report.json").write_text(json.dumps(report))
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1", "2", "--arms", "dpo_density"]) == 2
    assert "seed 1's report has no policy 'DPO uniform'" in capsys.readouterr().err


def test_per_kind_accuracy_from_the_task_rewards_verdicts_dense_kinds_by_their_training_share():
    """A real task's held-out questions, balanced across kinds: the reward's verdict of each completion counted
    under its question's kind, and the kinds dense or rare by their share of the training pairs, not of these rows."""
    rows = [PromptRow([{"role": "user", "content": f"q{i}"}], str(i), {"kind": kind, "share": share}, i)
            for i, (kind, share) in enumerate([("sum", 0.45), ("sum", 0.45), ("product", 0.05), ("product", 0.05)])]
    greedy = [(i, "x", math.nan, 1) for i in range(4)]
    sampled = [(i, "x", math.nan, 1) for i in (0, 0, 1, 1, 2, 2, 3, 3)]
    verdicts = {"greedy": [True, True, False, True], "sampled": [True, False, True, True, False, False, True, False]}
    m = policy_measures("ckpt", rows, greedy, sampled, verdicts, {}, {})
    assert m["dense_topics"] == ["sum"]
    assert (m["task_accuracy_greedy_dense"], m["task_accuracy_greedy_rare"]) == (1.0, 0.5)
    assert (m["task_accuracy_sampled"], m["task_accuracy_sampled_dense"], m["task_accuracy_sampled_rare"]) == \
        (0.5, 0.75, 0.25)
    assert m["task_accuracy_by_topic"] == {"greedy": {"product": 0.5, "sum": 1.0},
                                           "sampled": {"product": 0.25, "sum": 0.75}}
    assert m["task_accuracy_gap_dense_rare"] == 0.5 and m["topic_accuracy_spread"] == 0.25
    balanced = [PromptRow(r.messages, r.prefix_id, {"kind": r.row["kind"]}, r.line) for r in rows]
    m = policy_measures("ckpt", balanced, greedy, sampled, verdicts, {}, {})  # word_arithmetic's: kinds, no skew
    assert m["dense_topics"] is None and m["task_accuracy_greedy_dense"] is m["task_accuracy_greedy_rare"] is None
    assert m["task_accuracy_by_topic"]["greedy"] == {"product": 0.5, "sum": 1.0}
    untagged = [PromptRow(r.messages, r.prefix_id, {}, r.line) for r in rows]  # prompts with no kind: no groups
    m = policy_measures("ckpt", untagged, greedy, sampled, verdicts, {}, {})
    assert m["task_accuracy_greedy"] == 0.75 and m["task_accuracy_greedy_rare"] is None
    assert m["task_accuracy_by_topic"] == {"greedy": {}, "sampled": {}}


def test_weights_by_topic_read_the_demos_pairs_as_the_trainers_do(tmp_path):
    """The demo's pairs (a plain-string prompt, a "topic"): each topic's share and mean weight, keyed by the prefix id
    our pair reader gives each row, as the density stage and the trainers key them."""
    (tmp_path / "seed_0").mkdir()
    pairs = write_jsonl(tmp_path / "pairs.jsonl", synthetic.make_pairs(60, seed=1))
    topic = {n: row["topic"] for n, row in read_rows(str(pairs))}
    weight = {"weather": 0.5}
    write_jsonl(tmp_path / "w.jsonl", [{"prefix_id": r.prefix_id, "weight": weight.get(topic[r.line], 2.0)}
                                       for r in load_pairs(pairs)[0]])
    density = f"python -m scripts.kat_compute_density --pairs {pairs} --out {tmp_path / 'w.jsonl'}"
    report = {"stages": {"density": density}}
    by_topic = kat_experiment_report.weights_by_topic({0: report})
    assert by_topic["weather"]["weight"] == [0.5] and by_topic["chess"]["weight"] == [2.0]
    assert abs(sum(t["share"][0] for t in by_topic.values()) - 1) < 1e-9 and by_topic["weather"]["share"][0] > 0.2
    # a seed whose pairs hold no weather: share 0 there, no weight, shown '-'; the mean weight over the seeds with one
    no_weather = write_jsonl(tmp_path / "no_weather.jsonl", [r for r in synthetic.make_pairs(60, seed=1)
                                                             if r["topic"] != "weather"])
    two = kat_experiment_report.weights_by_topic({0: report, 1: {"stages": {"density": density.replace(
        str(pairs), str(no_weather))}}})
    assert two["weather"]["share"][1] == 0.0 and two["weather"]["weight"] == [0.5, None]
    assert two["chess"]["weight"] == [2.0, 2.0]
    weather = [line for line in kat_experiment_report.weights_section(two) if line.startswith("| weather |")]
    assert weather == [f"| weather | {two['weather']['share'][0] / 2:.3f} | 0.500 | 0.500, - |"]
    (tmp_path / "w.jsonl").unlink()  # the report rebuilt where the density stage's files are not: no weights section
    assert kat_experiment_report.weights_by_topic({0: report}) == {}


def test_the_real_models_experiment_reports_weights_and_accuracy_by_kind(tmp_path):
    """EXPERIMENT=density MODEL=smollm2's report: dpo_density against dpo only (no GRPO arm there), each kind's share
    of the pairs and mean density weight from the files the density stage read and wrote, per-kind accuracy rows with
    paired intervals, and whether the baseline leaves the rare kinds behind."""
    train, _ = make_skewed_questions(200, 8, seed=1)
    pairs = make_skewed_pairs(train, seed=2)
    for s in range(5):
        seed = tmp_path / f"seed_{s}"
        (seed / "tasks").mkdir(parents=True)
        (seed / "density").mkdir()
        (seed / "tasks" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        weight = {"sum": 0.8, "difference": 0.9, "product": 2.0 + 0.1 * s, "story": 1.5}
        (seed / "density" / "weights.jsonl").write_text("".join(
            json.dumps({"prefix_id": prefix_id_of(p["prompt"]), "weight": weight[p["kind"]]}) + "\n" for p in pairs))

        def policy(product: float) -> dict:
            by_kind = {"sum": 0.6, "difference": 0.5, "product": product, "story": 0.3}
            return {"task_accuracy_greedy": 0.5, "task_accuracy_sampled_rare": product / 2,
                    "dense_topics": ["difference", "sum"],
                    "task_accuracy_gap_dense_rare": 0.55 - (product + 0.3) / 2,
                    "task_accuracy_by_topic": {"greedy": by_kind, "sampled": by_kind}}

        report = {"reward_models": {}, "policies": {"before (smollm2)": policy(0.2), "DPO uniform": policy(0.2),
                                                    "DPO density": policy(0.3 + 0.01 * s)},
                  "stage_args": {"REGIME": "default", "MODEL": "smollm2", "TASK": "word_arithmetic_skewed"},
                  "stages": {"density": "python -m scripts.kat_compute_density --backbone m --pairs "
                                        f"{seed / 'tasks' / 'pairs.jsonl'} --out {seed / 'density' / 'weights.jsonl'}"}}
        (seed / "report.json").write_text(json.dumps(report))
    seeds = ["0", "1", "2", "3", "4"]
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", *seeds, "--arms", "dpo", "dpo_density"]) == 0
    out = json.loads((tmp_path / "experiment.json").read_text())
    assert set(out["arms"]) == {"dpo_density"} and out["model"] == "smollm2"
    product = out["arms"]["dpo_density"]["task_accuracy_greedy_product"]["diff"]
    assert [round(d, 3) for d in product["diffs"]] == [0.1, 0.11, 0.12, 0.13, 0.14] and product["low"] > 0
    assert out["arms"]["dpo_density"]["task_accuracy_sampled_sum"]["diff"]["mean"] == 0
    by_kind = out["weights_by_topic"]
    assert [round(w, 3) for w in by_kind["product"]["weight"]] == [2.0, 2.1, 2.2, 2.3, 2.4]
    assert by_kind["sum"]["share"] == [0.45] * 5 and by_kind["story"]["weight"] == [1.5] * 5
    md = (tmp_path / "experiment.md").read_text()
    assert md.startswith("# The density experiment on a real model (smollm2)")
    assert "| product | 0.050 | 2.200 | 2.000, 2.100, 2.200, 2.300, 2.400 |" in md
    assert "task_accuracy_greedy_product better by 0.120" in md
    assert "- before training: +0.300, +0.300" in md and "- dpo: +0.300" in md
    # the headline is the rare kinds' gain and the dense kinds' cost (one sample a question: no diversity measures)
    assert (tmp_path / "experiment_task_accuracy_sampled_rare.png").is_file()
    assert not (tmp_path / "experiment_distinct_2.png").exists()
    # the default arms: those whose baseline ran (dpo's, GRPO's uniform arm, did not)
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", *seeds]) == 0
    assert set(json.loads((tmp_path / "experiment.json").read_text())["arms"]) == {"dpo_density"}


def test_the_registered_verdict_rebuilds_from_the_seeds_kept_summaries(tmp_path):
    """docs/ keeps each registered seed's report.json (its density weights by kind inside it) and not the pairs and
    weights a seed and the commit regenerate: the registered report and its verdict rebuild from those alone."""
    kept = REPO / "docs" / "density_experiment" / "smollm2_grpo" / "registered"
    seeds = sorted(int(d.name.split("_")[1]) for d in kept.glob("seed_*"))
    assert seeds == list(range(20, 35))
    for s in seeds:
        (tmp_path / f"seed_{s}").mkdir()
        shutil.copy(kept / f"seed_{s}" / "report.json", tmp_path / f"seed_{s}" / "report.json")
    args = ["--root", str(tmp_path), "--seeds", *map(str, seeds), "--arms", "uniform", "density"]
    assert kat_experiment_report.main(args) == 0
    assert (tmp_path / "experiment.md").read_text() == (kept / "experiment.md").read_text()  # figures rounded
    # the JSON's full-precision intervals come through libm (lgamma, exp): equal to rounding on another machine's
    assert same_numbers(json.loads((tmp_path / "experiment.json").read_text()),
                        json.loads((kept / "experiment.json").read_text()))
    assert "## Do the density weights find the rare kinds?" in (tmp_path / "experiment.md").read_text()


def same_numbers(a, b) -> bool:
    """a and b hold the same structure, strings and None, and numbers equal to 1e-9 relative (NaN equal to NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_numbers(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same_numbers, a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b))
    return a == b
