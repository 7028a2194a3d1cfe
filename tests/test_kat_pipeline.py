"""scripts/kat_pipeline.py: what speedrun.sh and pipelines/*.sh read from a run's files between stages."""

import json
import os
import subprocess
import sys

from conftest import REPO

from scripts import kat_pipeline


def run(*args: str, **env: str) -> str:
    given = {k: v for k, v in os.environ.items() if k not in ("REGIME", "GRPO_ARGS", "RM_STEPS")}
    return subprocess.run([sys.executable, "-m", "scripts.kat_pipeline", *args], cwd=REPO, env={**given, **env},
                          check=True, capture_output=True, text=True).stdout


def test_stage_args_records_each_setting_given_and_blank_where_unset(tmp_path):
    out = tmp_path / "stage_args.json"
    run("stage_args", str(out), "REGIME", "GRPO_ARGS", "RM_STEPS", REGIME="collapse", GRPO_ARGS="--lr 1e-3 --beta 0")
    assert json.loads(out.read_text()) == {"REGIME": "collapse", "GRPO_ARGS": "--lr 1e-3 --beta 0", "RM_STEPS": ""}


def test_max_new_tokens_is_the_newest_checkpoints_not_the_last_listed(tmp_path):
    for step, tokens in [(9, 16), (10, 24), (2, 8)]:  # step 10 is the newest: sorted as text it would be first
        (tmp_path / f"meta_{step}.json").write_text(json.dumps({"args": {"max_new_tokens": tokens}}))
    assert run("max_new_tokens", str(tmp_path)) == "--max_new_tokens 24\n"


def test_the_summary_reads_a_demo_report_and_a_model_report(tmp_path):
    demo = {"reward_models": {"/b/rm_checkpoints/uniform": {"overall": {"accuracy": 0.93}}},
            "policies": {"GRPO uniform": {"task_accuracy_sampled": 0.85, "rm_score_sampled": 1.5, "distinct_2": 0.4,
                                          "tool_use": {"accuracy_with_tools": 0.9, "accuracy_without_tools": 0.2,
                                                       "tool_calls": 1.0, "tool_errors": 0.0}},
                         "SFT": {"task_accuracy_sampled": None, "rm_score_sampled": 0.5, "distinct_2": 0.6}}}
    (tmp_path / "demo.json").write_text(json.dumps(demo))
    assert kat_pipeline.summary(str(tmp_path / "demo.json")) == [
        "  rm uniform: held-out accuracy 0.930",
        "  policy GRPO uniform: task accuracy (sampled) 0.850, RM score (sampled) 1.500, distinct-2 0.400",
        "  policy GRPO uniform: arithmetic accuracy with the calculator 0.900, without 0.200; 1.00 calls per "
        "completion, 0.000 refused",
        "  policy SFT: task accuracy (sampled) -, RM score (sampled) 0.500, distinct-2 0.600"]
    model = {"reward_models": {"/b/rm_checkpoints/uniform": {}}, "policies": {"GRPO smollm2": {
        "task_accuracy_greedy": 0.5, "task_accuracy_sampled": 0.25, "rm_score_sampled": float("nan"),
        "examples": [{"prompt": "What is 2 plus 3?", "completion": "5"}]}}}
    (tmp_path / "model.json").write_text(json.dumps(model))
    # a demo's RMs in the same base dir are scored beside a MODEL run's policies: its summary is the task's still
    assert kat_pipeline.summary(str(tmp_path / "model.json"), model=True) == [
        "  policy GRPO smollm2: held-out accuracy greedy 0.500, sampled 0.250; e.g. 'What is 2 plus 3?' -> '5'"]
