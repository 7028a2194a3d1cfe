"""kat_own_pairs: DPO's pairs in a policy's own words. Its samples are judged by the task's reward and the best is
chosen over the worst; on 2 ranks the same pairs as on 1 (each prompt's own sampling generator); the file is what
the DPO reader takes; an existing --out is refused in one line, untouched."""
from __future__ import annotations

import json

from conftest import REPO, assert_stopped, run_script

from nanochat_ext.algorithms.own_pairs import best_and_worst
from nanochat_ext.data.rows import load_pairs, load_prompts


def test_the_best_sample_is_chosen_over_the_worst_and_equal_samples_give_no_pair():
    assert best_and_worst([0.0, 1.0, 0.0, 1.0]) == (1, 0)  # the first of equals, each side
    assert best_and_worst([0.5, 0.2, 0.9]) == (2, 1)
    assert best_and_worst([1.0, 1.0]) is None and best_and_worst([0.0, 0.0, 0.0]) is None
    assert best_and_worst([None, 1.0, 0.0, None]) == (1, 2)  # an empty reply (None) is never picked
    assert best_and_worst([None, 1.0]) is None


def test_pairs_on_two_ranks_are_one_ranks_and_train_dpo(assets, tmp_path):
    flags = ["--policy", str(assets["gpt"]), "--prompts", str(assets["pairs"]), "--reward_fn",
             "rewards_for_tests:vowel_share", "--max_prompts", "11", "--samples", "4", "--max_new_tokens", "6",
             "--prompts_per_call", "4"]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}  # the test's reward function
    files = {}
    for nproc in (1, 2):
        files[nproc] = tmp_path / f"pairs_{nproc}.jsonl"
        proc = run_script("scripts.kat_own_pairs", flags + ["--out", str(files[nproc])], nproc=nproc, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "pairs from 11 prompts (4 samples each" in proc.stdout
    one = [json.loads(line) for line in files[1].read_text().splitlines()]
    assert one and one == [json.loads(line) for line in files[2].read_text().splitlines()]
    prompts = {json.dumps(r.messages) for r in load_prompts(assets["pairs"])[:11]}
    for pair in one:
        assert json.dumps(pair["prompt"]) in prompts and pair["chosen_reward"] > pair["rejected_reward"]
        assert "topic" in pair and pair["prefix_id"]  # the prompt row's kind and group, for --density, --val_ratio
        assert pair["chosen"][0]["content"].strip() and pair["rejected"][0]["content"].strip()
    rows, skipped = load_pairs(files[1])  # what kat_train_dpo reads
    assert len(rows) == len(one) and not skipped
    before = files[1].read_text()
    again = run_script("scripts.kat_own_pairs", flags + ["--out", str(files[1])], env=env)
    assert_stopped(again, 2, ": exists (remove it to draw the pairs again)")
    assert files[1].read_text() == before


def test_no_pair_at_all_or_an_out_that_cannot_be_written_is_one_line_and_no_file(assets, tmp_path):
    """Prompts whose samples all score alike give no pair: one line, no file. An --out whose directory cannot be made
    is refused before the model loads."""
    def own_pairs(out):
        return run_script("scripts.kat_own_pairs", [
            "--policy", str(assets["gpt"]), "--prompts", str(assets["pairs"]), "--reward_fn", "rewards_for_tests:zero",
            "--max_prompts", "3", "--samples", "2", "--max_new_tokens", "2", "--out", str(out)],
            env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})

    out = tmp_path / "pairs.jsonl"
    assert_stopped(own_pairs(out), 2,
                   "no pair: each prompt's 2 samples scored alike under --reward_fn (mean reward 0.000)")
    assert not list(tmp_path.iterdir())  # nothing half-written
    (tmp_path / "a_file").write_text("")
    assert_stopped(own_pairs(tmp_path / "a_file" / "pairs.jsonl"), 2, "a_file: dir cannot be written (File exists)")
