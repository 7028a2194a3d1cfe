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
    assert kat_experiment_report.main(["--root", str(tmp_path), "--seeds", "0", "9"]) == 2  # seed 9 has no report
