"""speedrun.sh end to end with tiny settings: every stage runs, a re-run skips them all, an interrupted
stage resumes, and a missing artifact stops the pipeline with a message. One pipeline run serves all of it:
EXPERIMENT=density runs the plain pipeline (the same speedrun.sh, EXPERIMENT unset) once per seed, so a
one-seed experiment covers every stage (the fork's arm in a last run) and the experiment's own report, and a re-run
skips its stages; each stage is a torchrun of 2 ranks, about 8 s at these sizes, most of it starting the processes.
The real-model commands run with a tiny Llama standing in for the converted model."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import REPO

from nanochat_ext.models.converted import MARKER
from nanochat_ext.tasks import synthetic

# OMP_NUM_THREADS=1 whatever the caller's: 2 ranks of 2 threads each would oversubscribe 2 cores.
TINY = {"NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "SFT_STEPS": "8", "RM_STEPS": "4", "GRPO_STEPS": "4",
        "DPO_STEPS": "4", "EVAL_SAMPLES": "2", "DEMO_ARGS": "--n_pairs 200 --n_sft 200 --n_prompts 40 --n_eval 16"}


def speedrun(base, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **TINY, "NANOCHAT_BASE_DIR": str(base), **env}
    return subprocess.run(["bash", str(REPO / "speedrun.sh")], env=full, capture_output=True, text=True, timeout=600)


def test_density_experiment_end_to_end_skips_and_resumes(tmp_path):
    """EXPERIMENT=density REGIME=collapse, shortened: one seed on 2 ranks with three GRPO arms (a KL control too),
    each seed's report and the experiment's (the DPO arms: test_the_density_experiment_on_a_model_runs_both_dpo_arms,
    on 1 rank, and test_dpo's 2 ranks under cuda:gloo; their report: test_experiment_report); a re-run skips every
    finished stage; an interrupted GRPO stage resumes, with flags passed through to it (GRPO_ARGS); the fork's arm
    computes its weights, and a bad flag passed to its RM stage (RM_ARGS) fails it in one line."""
    base = tmp_path / "base"
    # BACKEND=cuda:gloo: a default process group that serves only CUDA tensors, as NCCL does. Every stage's
    # real collective sequence (losses, metrics, eval sums, objects, DDP) must then route each CPU tensor
    # to a group that serves CPU: on 2 CPU ranks this holds the pipeline to NCCL's device rule.
    env = dict(EXPERIMENT="density", REGIME="collapse", SEEDS="0", ARMS="uniform density kl_0.1",
               EXPERIMENT_RM_STEPS="40", BACKEND="cuda:gloo", GRPO_ARGS="--lr 5e-4")
    first = speedrun(base, **env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    root = base / "experiment_collapse"
    seed = root / "seed_0"
    for stage in ("demo_data", "sft", "density", "rm_uniform", "rm_density", "grpo_uniform", "grpo_density",
                  "grpo_kl_0.1", "eval"):
        assert f"== {stage}" in first.stdout
    report = json.loads((seed / "report.json").read_text())
    assert set(report["policies"]) == {"before (SFT)", "GRPO uniform", "GRPO density", "GRPO kl_0.1"}
    assert {"task_accuracy_sampled", "rm_score_sampled", "mode_share"} <= set(report["policies"]["GRPO kl_0.1"])
    assert {"task_accuracy_sampled_rare", "duplicate_share", "topic_accuracy_spread", "mode_share",
            "top_completion_share", "task_accuracy_gap_dense_rare"} <= set(report["policies"]["GRPO density"])
    assert {d.rsplit("/", 1)[-1] for d in report["reward_models"]} == {"uniform", "density"}
    # The demo's RM recipe learns (#89: the script's default lr for trained blocks, which the tiny model was never run
    # at, left these RMs at 0.56 held-out accuracy and a margin of 0.03 after 40 steps; the recipe's 3e-3: 0.84, 7.6)
    for rm in report["reward_models"].values():
        assert rm["overall"]["accuracy"] >= 0.75 and rm["overall"]["margin"] > 3, rm["overall"]
    assert "rare topics" in report["reward_models"][str(seed / "rm_checkpoints" / "uniform")]
    assert report["stage_args"]["REGIME"] == "collapse"

    def grpo_args(arm: str) -> dict:
        ckpts = seed / "chatrl_checkpoints" / arm
        return json.loads(max(ckpts.glob("meta_*.json"), key=lambda p: int(p.stem.split("_")[1])).read_text())["args"]

    # the regime's flags reach every arm, GRPO_ARGS after them (your --lr wins), the kl arm's beta after both;
    # the kl arm trains against the uniform RM
    assert (grpo_args("uniform")["lr"], grpo_args("uniform")["beta"]) == (5e-4, 0)
    assert (grpo_args("kl_0.1")["lr"], grpo_args("kl_0.1")["beta"]) == (5e-4, 0.1)
    assert grpo_args("kl_0.1")["rm"] == str(seed / "rm_checkpoints" / "uniform")
    md = (seed / "report.md").read_text()
    assert "## Wall time per stage" in md and "grpo_uniform.png" in md and (seed / "grpo_uniform.png").is_file()
    assert "REGIME=`collapse`" in md and "GRPO_STEPS=`4`" in md
    experiment = json.loads((root / "experiment.json").read_text())
    assert set(experiment["arms"]) == {"density", "kl_0.1"} and experiment["regime"] == "collapse"
    assert len(experiment["arms"]["density"]["rm_accuracy_rare"]["diff"]["diffs"]) == 1
    assert "One seed: differences only" in (root / "experiment.md").read_text()
    assert "## density minus uniform" in (root / "experiment.md").read_text()
    # A re-run with fewer arms skips every stage it asks for and reports on those arms (the report's intervals over
    # several seeds: test_experiment_report; a pipeline on 1 rank: test_your_model_runs_with_the_scripts_defaults).
    again = speedrun(base, **{**env, "ARMS": "uniform density"})
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": skipped") == 8, again.stdout  # demo_data, sft, density, 2 RMs, 2 GRPO, eval
    assert set(json.loads((root / "experiment.json").read_text())["arms"]) == {"density"}
    md = (root / "experiment.md").read_text()
    assert md.startswith("# The density experiment, regime collapse") and "## Does training collapse here?" in md

    # GRPO "killed" after its step-2 checkpoint: the re-run resumes it and finishes the pipeline.
    grpo = seed / "chatrl_checkpoints" / "uniform"
    (grpo / ".complete").unlink()
    stamps = sorted(int(p.stem.split("_")[1]) for p in grpo.glob("model_*.pt"))
    for name in (f"model_{stamps[-1]}.pt", f"meta_{stamps[-1]}.json", f"state_{stamps[-1]}.pt"):
        (grpo / name).unlink()
    # GRPO_ARGS reach the stage after its own flags (the last copy wins), and the report records them.
    passed = "--lr 5e-4 --top_k 0 --top_k 5"
    resumed = speedrun(base, **{**env, "GRPO_ARGS": passed})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "== grpo_uniform (2 ranks), resuming" in resumed.stdout and "resume: from" in resumed.stdout
    assert "== sft: skipped" in resumed.stdout and "== grpo_density: skipped" in resumed.stdout
    assert "== eval (2 ranks)" in resumed.stdout
    final = max(grpo.glob("meta_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    assert json.loads(final.read_text())["args"]["top_k"] == 5
    assert json.loads((seed / "report.json").read_text())["stage_args"]["GRPO_ARGS"] == passed
    assert f"GRPO_ARGS=`{passed}`" in (seed / "report.md").read_text()

    # The fork's arm (1 rank): its weights (mean 1), then a bad flag in RM_ARGS fails its RM stage with the stage's
    # own line.
    bad = speedrun(base, **{**env, "NPROC_PER_NODE": "1", "ARMS": "uniform fork"}, RM_ARGS="--weight_cap 0")
    assert bad.returncode == 1 and "== density_fork (1 ranks)" in bad.stdout  # speedrun's code for a failed stage
    assert "speedrun: stage rm_fork failed: --weight_cap must be > 0" in bad.stderr, bad.stderr[-2000:]
    weights = [json.loads(line)["weight"]
               for line in (seed / "density" / "fork_weights.jsonl").read_text().splitlines()]
    assert abs(sum(weights) / len(weights) - 1) < 1e-3


@pytest.mark.parametrize("env,line", [
    ({"ARMS": "uniform kl_abc"}, "speedrun: unknown arm 'kl_abc' in ARMS"),
    ({"REGIME": "wild"}, "speedrun: unknown REGIME 'wild' (default, collapse)"),
    ({"EXPERIMENT": "density", "ARMS": "density kl_0.2"}, "compares each arm with uniform: add it to ARMS"),
    ({"EXPERIMENT": "density", "ARMS": "uniform dpo_density"}, "compares dpo_density with dpo: add it to ARMS"),
    ({"EXPERIMENT": "density", "MODEL": "smollm2", "ARMS": "uniform"}, "the experiment's arms are dpo dpo_density"),
    ({"EXPERIMENT": "density", "MODEL": "smollm2", "ARMS": "dpo_density"}, "compares dpo_density with dpo"),
    ({"EXPERIMENT": "density", "MODEL": "smollm2", "ARMS": "density"}, "compares density with uniform: add it to ARMS"),
    ({"EXPERIMENT": "density", "MODEL": "smollm2", "ARMS": "uniform density", "OWN_PAIRS": "1"},
     "OWN_PAIRS=1 makes pairs for DPO arms"),
    ({"OWN_PAIRS": "yes"}, "speedrun: OWN_PAIRS is 0 or 1, got 'yes'"),
    ({"OWN_PAIRS": "1"}, "speedrun: OWN_PAIRS=1 needs MODEL"),
    ({"MODEL": "smollm2", "ARMS": "uniform dpo"}, "with MODEL, ARMS is uniform and/or density (GRPO with the task's"),
    ({"EXPERIMENT": "dense"}, "speedrun: unknown EXPERIMENT 'dense' (density, or unset for the pipeline)")])
def test_bad_arms_and_regimes_stop_before_any_stage(tmp_path, env, line):
    proc = speedrun(tmp_path / "base", **env)
    assert proc.returncode == 2 and line in proc.stderr and "==" not in proc.stdout, proc.stdout + proc.stderr
    if "EXPERIMENT" in line:  # before anything is made
        assert proc.stderr.strip().splitlines() == [line] and not (tmp_path / "base").exists()


def test_missing_data_stops_the_pipeline(tmp_path):
    empty = tmp_path / "pairs.jsonl"
    empty.write_text("")
    proc = speedrun(tmp_path / "base", BACKBONE=str(tmp_path / "nope"), PAIRS=str(empty))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"speedrun: {empty} is missing or empty (PAIRS/PROMPTS, or the demo_data stage makes them)"], proc.stderr


def test_your_model_runs_with_the_scripts_defaults_and_is_judged_on_held_out_prompts(assets, tmp_path):
    """BACKBONE (a Hugging Face dir) and PAIRS: every stage runs with its script's defaults, set for real models, and
    what the user asked for (the step counts, GRPO_ARGS), none of the demo's recipe; each stage's meta records its
    flags and the report lists each stage's command; with no EVAL_PAIRS/EVAL_PROMPTS the report judges the prompts
    the trainers held out of the training files and says so, and names no stage that did not run."""
    base = tmp_path / "base"
    proc = speedrun(base, NPROC_PER_NODE="1", BACKBONE=str(assets["hf"]), PAIRS=str(assets["pairs"]), RM_STEPS="2",
                    GRPO_STEPS="2", EVAL_SAMPLES="1", GRPO_ARGS="--max_new_tokens 8 --batch_size 4 --group_size 4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def flags(stage_dir) -> dict:
        metas = sorted(stage_dir.glob("meta_*.json"))
        return json.loads(metas[-1].read_text())["args"]

    rm, grpo = flags(base / "rm_checkpoints" / "uniform"), flags(base / "chatrl_checkpoints" / "uniform")
    assert (rm["unfreeze_last"], rm["batch_size"], rm["lr"], rm["max_steps"]) == ("0", 32, 3e-3, 2)  # the demo: 1
    assert (grpo["lr"], grpo["beta"], grpo["max_steps"], grpo["max_new_tokens"]) == (1e-6, 0.04, 2, 8)
    report = (base / "report.md").read_text()
    assert "on held-out (the 10% of the training files' prompts, by prefix_id, the trainers held out) prompts" in report
    assert "- rm_uniform: `python -m scripts.kat_train_rm --backbone" in report and "--unfreeze_last" not in report
    assert "== grpo_uniform" in proc.stdout and "grpo_uniform: python -m scripts.kat_train_grpo --policy" in proc.stdout
    ran = json.loads((base / "report.json").read_text())["stage_args"]
    assert "SFT_STEPS" not in ran and "DPO_STEPS" not in ran and ran["GRPO_STEPS"] == "2"


def converted_stand_in(directory) -> str:
    """A tiny Llama standing in for the converted model: MODEL_DIR holding a finished conversion is used as it is."""
    model = synthetic.make_tiny_hf_llama(directory, template="chatml")
    (model / MARKER).write_text("{}")
    return str(model)


def test_the_real_model_command_runs_grpo_with_the_tasks_reward(tmp_path):
    """MODEL=smollm2 bash speedrun.sh with a stand-in model, nothing fetched: the task's questions, GRPO with its
    preset and the task's reward, the report of held-out accuracy before and after; a re-run skips every stage, the
    evaluation too."""
    env = dict(MODEL="smollm2", MODEL_DIR=converted_stand_in(tmp_path / "model"), NPROC_PER_NODE="1", GRPO_STEPS="1",
               EVAL_SAMPLES="1", GRPO_ARGS="--eval_every 0")
    first = speedrun(tmp_path / "base", **env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "== grpo_smollm2 (1 ranks)" in first.stdout and "== eval (1 ranks)" in first.stdout
    report = json.loads((tmp_path / "base" / "report.json").read_text())
    assert set(report["policies"]) == {"before (smollm2)", "GRPO smollm2"}
    assert report["policies"]["GRPO smollm2"]["task_accuracy_by_topic"]["greedy"].keys() == {
        "sum", "difference", "product", "story"}  # word_arithmetic's kinds, balanced: no dense and rare split
    assert report["policies"]["GRPO smollm2"]["task_accuracy_greedy_rare"] is None
    again = speedrun(tmp_path / "base", **env)
    assert again.returncode == 0 and "== eval: skipped" in again.stdout and again.stdout.count(": skipped") == 3


def test_the_density_experiment_on_a_model_runs_both_dpo_arms_on_its_own_words(tmp_path):
    """EXPERIMENT=density MODEL=smollm2 OWN_PAIRS=1, one seed, a stand-in model: the GRPO form's skew, pairs in the
    model's own words (its samples judged by the task's reward; the stand-in never answers right, so a reward that
    tells its samples apart is added through OWN_PAIRS_ARGS), density weights of those pairs' prompts, DPO uniform
    and density-weighted on them, the evaluation by kind at the pairs' length, the experiment's report with the
    weights by kind. (Without OWN_PAIRS the DPO form reads the task's own pairs on the other skew: the same stages.)"""
    proc = speedrun(tmp_path / "base", EXPERIMENT="density", MODEL="smollm2", OWN_PAIRS="1", SEEDS="0",
                    NPROC_PER_NODE="1", MODEL_DIR=converted_stand_in(tmp_path / "model"), DPO_STEPS="1",
                    EVAL_SAMPLES="1", OWN_PAIRS_ARGS="--reward_fn rewards_for_tests:vowel_share --max_prompts 48",
                    PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("task_data", "own_pairs", "density", "dpo", "dpo_density", "eval"):
        assert f"== {stage}" in proc.stdout
    root = tmp_path / "base" / "experiment_smollm2_own"
    seed = root / "seed_0"
    pairs = [json.loads(line) for line in (seed / "own_pairs" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
    policies = json.loads((seed / "report.json").read_text())["policies"]
    assert set(policies) == {"before (smollm2)", "DPO uniform", "DPO density"}
    assert policies["DPO density"]["dense_topics"] == ["product", "story"]
    meta = max((seed / "dpo_checkpoints" / "dpo_density").glob("meta_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    args = json.loads(meta.read_text())["args"]
    assert (args["density"], args["pairs"]) == (str(seed / "density" / "weights.jsonl"),
                                                str(seed / "own_pairs" / "pairs.jsonl"))
    assert "--max_new_tokens 16" in dict(line.split("\t", 1)
                                         for line in (seed / "stages.tsv").read_text().splitlines())["eval"]
    experiment = json.loads((root / "experiment.json").read_text())
    assert set(experiment["arms"]) == {"dpo_density"} and experiment["model"] == "smollm2"
    assert {kind for kind, w in experiment["weights_by_topic"].items()} <= {"sum", "difference", "product", "story"}
    # each kind's share of the pairs (prompts whose samples the reward told apart), not of the prompts
    shares = {kind: w["share"][0] for kind, w in experiment["weights_by_topic"].items()}
    assert abs(sum(shares.values()) - 1) < 1e-9 and shares["product"] + shares["story"] > 0.5, shares
    assert "trained by DPO on preference pairs in the model's own words" in (root / "experiment.md").read_text()


def test_the_density_experiment_on_a_model_in_its_grpo_form(tmp_path):
    """EXPERIMENT=density MODEL=smollm2 ARMS="uniform density", one seed, a stand-in model: the set whose rare kinds the
    model is behind on (word_arithmetic_gap), density weights from the model's embeddings, GRPO with the task's reward
    uniform and with each prompt's weight, the evaluation by kind, density compared with uniform in its own root."""
    proc = speedrun(tmp_path / "base", EXPERIMENT="density", MODEL="smollm2", ARMS="uniform density", SEEDS="0",
                    NPROC_PER_NODE="1", MODEL_DIR=converted_stand_in(tmp_path / "model"), GRPO_STEPS="1",
                    EVAL_SAMPLES="1", GRPO_ARGS="--eval_every 0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("== ")}
    assert {"task_data", "density", "grpo_smollm2", "grpo_smollm2_density", "eval"} <= started, started
    root = tmp_path / "base" / "experiment_smollm2_grpo"
    policies = json.loads((root / "seed_0" / "report.json").read_text())["policies"]
    assert set(policies) == {"before (smollm2)", "GRPO uniform", "GRPO density"}
    assert policies["GRPO density"]["dense_topics"] == ["product", "story"]
    meta = max((root / "seed_0" / "chatrl_checkpoints" / "smollm2_density").glob("meta_*.json"),
               key=lambda p: int(p.stem.split("_")[1]))
    assert json.loads(meta.read_text())["args"]["density"] == str(root / "seed_0" / "density" / "weights.jsonl")
    experiment = json.loads((root / "experiment.json").read_text())
    assert set(experiment["arms"]) == {"density"} and experiment["model"] == "smollm2"
    assert {kind: w["share"] for kind, w in experiment["weights_by_topic"].items()} == {
        "sum": [0.05], "difference": [0.05], "product": [0.45], "story": [0.45]}
    assert "trained by GRPO with its task's reward" in (root / "experiment.md").read_text()
