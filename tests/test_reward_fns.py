"""The rule-based rewards shipped for --reward_fn, and the density stage's neighbour distances."""
import json
import re

import pytest
import torch

from nanochat_ext.data import load_prompts
from nanochat_ext.errors import InputError
from nanochat_ext.reward_fns import BUILT_IN, contains_answer, exact_match, gsm8k
from nanochat_ext.rewards import check_references
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
    ("nanochat_ext.reward_fns:exact_match", {"answer": ""}, "missing or empty"),
    ("contains_answer", {"topic": "x"}, "missing or empty"),
])
def test_a_built_in_reward_refuses_rows_without_its_reference_naming_file_row_and_field(tmp_path, name, row, expected):
    path = tmp_path / "prompts.jsonl"
    good = {"prompt": "q", "answer": "She has <<3+2=5>>5 left.\n#### 5"}
    path.write_text("".join(json.dumps({"prompt": "q", **r}) + "\n" for r in (good, row)))
    rows = load_prompts(path)
    check_references(["rewards_for_tests:vowel_share"], rows, str(path))  # a user's function reads what it likes
    check_references([name], rows[:1], str(path))
    with pytest.raises(InputError, match=rf"^{re.escape(str(path))}:2: field 'answer': .*{re.escape(expected)}"):
        check_references(["rewards_for_tests:vowel_share", name], rows, str(path))
    assert set(BUILT_IN) == {"gsm8k", "gsm8k_numeric", "exact_match", "contains_answer"}  # each checked above


def test_isolated_points_are_farther_from_their_neighbours():
    emb = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0]])
    d = knn_distances(emb, [0, 1, 2, 3], k=2)
    assert d[3] > 3 * d[:3].max()
    # Any subset of rows (one rank's share) gives the same values as the whole.
    torch.testing.assert_close(knn_distances(emb, [3, 1], k=2), d[[3, 1]])
