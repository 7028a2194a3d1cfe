"""The rule-based rewards shipped for --reward_fn, and the density stage's neighbour distances."""
import json
import random
import re
from collections import Counter

import pytest
import torch

from nanochat_ext.algorithms.rewards import check_references
from nanochat_ext.data.rows import load_pairs, load_prompts
from nanochat_ext.errors import InputError
from nanochat_ext.tasks.reward_fns import BUILT_IN, contains_answer, exact_match, gsm8k, last_number
from nanochat_ext.tasks.word_arithmetic import (
    GAP_SKEW,
    KINDS,
    SKEW,
    in_words,
    kinds_in_shares,
    make_gap_questions,
    make_pairs,
    make_questions,
    make_skewed_pairs,
    make_skewed_questions,
)
from scripts import kat_compute_density, kat_task_data
from scripts.kat_compute_density import knn_distances


def test_exact_match_reads_the_first_word():
    row = {"answer": "42"}
    assert exact_match("q", " 42. Because.", row) == 1.0
    assert exact_match("q", "The answer is 42", row) == 0.0
    assert exact_match("q", "Sure", {"answer": "sure"}) == 1.0


def test_contains_answer_needs_a_whole_word():
    row = {"answer": "42"}
    assert contains_answer("q", "It is 42.", row) == 1.0
    assert contains_answer("q", "It is 420.", row) == 0.0
    assert contains_answer("q", "anything", {"answer": ""}) == 0.0


def test_last_number_reads_the_replys_last_number_by_value():
    """What a small instruct model told to answer with the number only still writes: a sentence, the sum worked out."""
    row = {"answer": "81"}
    for reply in ("81", "The answer is 81.", "81.0", "80 + 1 = 81", "58 plus 23 is **81**"):
        assert last_number("q", reply, row) == 1.0, reply
    for reply in ("81 - 1 = 80", "8 1", "eighty-one", "", "810", "1,2,81,1"):
        assert last_number("q", reply, row) == 0.0, reply
    assert last_number("q", "It is 1,024", {"answer": "1024"}) == 1.0
    assert last_number("q", "-3", {"answer": -3}) == 1.0 and last_number("q", "3", {"answer": "-3"}) == 0.0
    assert last_number("q", "63-59", {"answer": "59"}) == 1.0 and last_number("q", "1,2,3", {"answer": "3"}) == 1.0


def test_word_arithmetic_answers_are_right_and_held_out_questions_unseen(tmp_path):
    train, held_out = make_questions(400, 64, seed=3)
    assert (len(train), len(held_out)) == (400, 64)
    number = re.compile(r"\d+")
    for row in train + held_out:  # the operands read back from the prompt give the stored answer
        phrasings, _, _, answer = KINDS[row["kind"]]
        for phrasing in phrasings:
            pattern = re.escape(phrasing).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
            if m := re.match(pattern, row["prompt"]):
                assert row["answer"] == str(answer(int(m["a"]), int(m["b"])))
                break
        else:
            raise AssertionError(f"no phrasing of {row['kind']} matches {row['prompt']!r}")
        assert number.findall(row["prompt"])
    assert {r["kind"] for r in held_out} == set(KINDS) and len({r["prompt"] for r in held_out}) == 64
    questions = {(r["kind"], tuple(number.findall(r["prompt"]))) for r in held_out}
    assert not questions & {(r["kind"], tuple(number.findall(r["prompt"]))) for r in train}
    assert make_questions(400, 64, seed=3) == (train, held_out)
    pairs_file = tmp_path / "pairs.jsonl"  # the task's pairs: our reader takes TRL's conversational format
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in make_pairs(train, seed=4)))
    pairs = load_pairs(pairs_file)[0]
    assert len(pairs) == 400
    for pair, row in zip(pairs, train):
        assert pair.prompt == [{"role": "user", "content": row["prompt"]}]
        assert last_number("", pair.chosen, row) == 1.0 and last_number("", pair.rejected, row) == 0.0


@pytest.mark.parametrize("flag,value", [("--n_train", "-5"), ("--n_train", "0"), ("--n_eval", "-1")])
def test_kat_task_data_refuses_a_count_below_its_least_writing_nothing(tmp_path, capsys, flag, value):
    out = tmp_path / "task"
    assert kat_task_data.main(["--out", str(out), flag, value]) == 2
    least = 1 if flag == "--n_train" else 0
    assert capsys.readouterr().err.splitlines() == [f"error: {flag} must be >= {least}, got {value}"]
    assert not out.exists()


def test_the_density_experiments_set_skews_training_kinds_and_balances_held_out_ones(tmp_path):
    """Two dense kinds and two rare ones in training, every kind alike held out, each row its kind's training share;
    the pairs' rejected reply a near miss or the right answer in words (the wrong format), which the task's reward
    scores wrong as it scores the chosen reply right."""
    train, held_out = make_skewed_questions(800, 96, seed=5)
    assert Counter(r["kind"] for r in train) == {"sum": 360, "difference": 360, "product": 40, "story": 40}
    assert Counter(r["kind"] for r in held_out) == {kind: 24 for kind in KINDS}
    assert all(r["share"] == SKEW[r["kind"]] for r in train + held_out)
    gap, gap_held_out = make_gap_questions(800, 96, seed=5)  # the GRPO form: the other two kinds rare
    assert Counter(r["kind"] for r in gap) == {"sum": 40, "difference": 40, "product": 360, "story": 360}
    assert Counter(r["kind"] for r in gap_held_out) == {kind: 24 for kind in KINDS}
    assert all(r["share"] == GAP_SKEW[r["kind"]] for r in gap + gap_held_out)
    number = re.compile(r"\d+")
    seen = {(r["kind"], tuple(number.findall(r["prompt"]))) for r in train}
    assert not seen & {(r["kind"], tuple(number.findall(r["prompt"]))) for r in held_out}
    pairs = make_skewed_pairs(train, seed=6)
    assert [(p["kind"], p["share"]) for p in pairs] == [(r["kind"], r["share"]) for r in train]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    words = 0
    for pair, row in zip(load_pairs(tmp_path / "pairs.jsonl")[0], train):
        assert last_number("", pair.chosen, row) == 1.0 and last_number("", pair.rejected, row) == 0.0
        if not number.search(pair.rejected):
            words += 1
            assert in_words(int(row["answer"])) in pair.rejected
    assert 0.2 < words / len(pairs) < 0.3
    # the plain task's pairs are what they were before the wrong format existed (no extra draw from the seed)
    assert [p["rejected"][0]["content"] for p in make_pairs(make_questions(6, 4, seed=0)[0], seed=1)] == [
        "The answer is 91.", "44", "It is 122.", "The answer is 90.", "72", "The answer is 33."]


def test_kinds_in_shares_rounds_by_largest_remainders_and_numbers_read_in_words():
    assert Counter(kinds_in_shares(7, {"x": 0.5, "y": 0.3, "z": 0.2}, random.Random(0))) == {"x": 4, "y": 2, "z": 1}
    assert Counter(kinds_in_shares(20, SKEW, random.Random(0))) == {"sum": 9, "difference": 9, "product": 1, "story": 1}
    assert kinds_in_shares(20, SKEW, random.Random(0)) != kinds_in_shares(20, SKEW, random.Random(1))  # shuffled
    assert [in_words(n) for n in (0, 13, 40, 42, 100, 105, 171, -3)] == [
        "zero", "thirteen", "forty", "forty-two", "one hundred", "one hundred and five", "one hundred and seventy-one",
        "minus three"]


def test_no_reference_is_never_a_match():
    """A row without a reference scores 0 whatever the completion (nanochat's GSM8K rule compares a missing reference
    equal to a missing answer, which scored every completion 1)."""
    for row in ({}, {"answer": ""}, {"answer": "She has 5 left."}):  # the last: no '#### ' line
        assert gsm8k("q", "I do not know", row) == 0.0
    assert exact_match("q", "", {}) == 0.0 and exact_match("q", "...", {"answer": " "}) == 0.0


@pytest.mark.parametrize("name,row,expected", [
    ("gsm8k", {"answer": "She has <<3+2=5>>5 left."}, "has no '#### <number>' line"),
    ("gsm8k_numeric", {}, "missing or empty"),
    ("gsm8k_numeric", {"answer": "#### 1.2.3"}, "'1.2.3' is not a number"),
    ("nanochat_ext.tasks.reward_fns:exact_match", {"answer": ""}, "missing or empty"),
    ("contains_answer", {"topic": "x"}, "missing or empty"),
    ("last_number", {"answer": "eighty-one"}, "'eighty-one' is not a number"),
    ("last_number", {"answer": "nan"}, "'nan' is not a number"),
])
def test_a_built_in_reward_refuses_rows_without_its_reference_naming_file_row_and_field(tmp_path, name, row, expected):
    path = tmp_path / "prompts.jsonl"
    good = {"prompt": "q", "answer": "5" if name == "last_number" else "She has <<3+2=5>>5 left.\n#### 5"}
    path.write_text("".join(json.dumps({"prompt": "q", **r}) + "\n" for r in (good, row)))
    rows = load_prompts(path)
    check_references(["rewards_for_tests:vowel_share"], rows, str(path))  # a user's function reads what it likes
    check_references([name], rows[:1], str(path))
    with pytest.raises(InputError, match=rf"^{re.escape(str(path))}:2: field 'answer': .*{re.escape(expected)}"):
        check_references(["rewards_for_tests:vowel_share", name], rows, str(path))
    assert set(BUILT_IN) == {"gsm8k", "gsm8k_numeric", "exact_match", "contains_answer", "last_number"}  # each above


def test_isolated_points_are_farther_from_their_neighbours():
    emb = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0]])
    d = knn_distances(emb, [0, 1, 2, 3], k=2)
    assert d[3] > 3 * d[:3].max()
    # Any subset of rows (one rank's share) gives the same values as the whole.
    torch.testing.assert_close(knn_distances(emb, [3, 1], k=2), d[[3, 1]])


def test_the_density_stage_never_replaces_weights_it_finds(assets, tmp_path, capsys):
    """Run after the demo with the demo's --out, the stage would replace the demo's weights (an RM trained on them
    stays, now on weights it was not trained with): it refuses in one line and leaves the file as it was."""
    out = tmp_path / "weights.jsonl"
    out.write_text('{"prefix_id": "a", "weight": 1.0}\n')
    args = ["--backbone", str(assets["gpt"]), "--tokenizer", str(assets["tokenizer"]), "--pairs", str(assets["pairs"]),
            "--out", str(out), "--device", "cpu"]
    assert kat_compute_density.main(args) == 2
    assert capsys.readouterr().err.strip() == (f"error: {out} exists (an earlier run's weights): give another --out, "
                                                f"or delete it to compute it again")
    assert out.read_text() == '{"prefix_id": "a", "weight": 1.0}\n'
