"""kat_experiment_report on hand-made per-seed reports: paired differences, intervals, the verdict."""
import json

from scripts import kat_experiment_report


def fake_report(seed: int, rare_uniform: float, rare_density: float) -> dict:
    def rm(rare):
        return {g: {"n": 10, "accuracy": a, "margin": 1.0} for g, a in
                (("overall", 0.8), ("dense topics", 0.9), ("rare topics", rare))}

    policy = {"rm_score_sampled": 0.1 * seed, "task_accuracy_sampled_rare": 0.5, "distinct_2": 0.9,
              "duplicate_share": 0.1}
    return {"reward_models": {"/x/rm_checkpoints/uniform": rm(rare_uniform), "/x/rm_checkpoints/density": rm(rare_density)},
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
    assert "## Does GRPO collapse here?" in md and "| mode_share | 0.250 | 0.895 | 0.800 | 0.310 |" in md
    assert "mode_share (lower is better)" in md and "top_completion_share (lower is better)" in md
    assert (tmp_path / "experiment_mode_share.png").is_file()

    # only the arms asked for, and each must be in every seed's report
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1", "--arms", "uniform", "kl_0.1"]) == 0
    assert set(json.loads((tmp_path / "experiment.json").read_text())["arms"]) == {"kl_0.1"}
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "1", "--arms", "uniform", "kl_0.2"]) == 2
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
