"""The rule-based rewards shipped for --reward_fn, and the density stage's neighbour distances."""
import torch

from nanochat_ext.reward_fns import contains_answer, exact_match
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


def test_isolated_points_are_farther_from_their_neighbours():
    emb = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [5.0, 5.0]])
    d = knn_distances(emb, [0, 1, 2, 3], k=2)
    assert d[3] > 3 * d[:3].max()
    # Any subset of rows (one rank's share) gives the same values as the whole.
    torch.testing.assert_close(knn_distances(emb, [3, 1], k=2), d[[3, 1]])
