"""The density experiment's interval arithmetic against textbook values."""
import math

import pytest

from nanochat_ext.tasks.stats import paired_difference, sample_diversity, t_cdf, t_quantile


@pytest.mark.parametrize("df,q975,q80", [(1, 12.7062, 1.3764), (4, 2.7764, 0.9410), (9, 2.2622, 0.8834),
                                         (30, 2.0423, 0.8538)])
def test_t_quantiles_match_the_tables(df, q975, q80):
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=2e-4)
    assert t_quantile(0.8, df) == pytest.approx(q80, abs=2e-4)
    assert t_cdf(0.0, df) == pytest.approx(0.5) and t_cdf(-q975, df) == pytest.approx(0.025, abs=1e-5)


def test_paired_t_interval():
    # differences 1..5: mean 3, sd sqrt(2.5), se 0.7071, t(4) 2.7764 -> 3 +- 1.9632
    d = paired_difference([2, 4, 6, 8, 10], [1, 2, 3, 4, 5])
    assert d.diffs == [1, 2, 3, 4, 5] and d.mean == 3
    assert (d.low, d.high) == pytest.approx((1.0368, 4.9632), abs=1e-4) and d.excludes_zero
    assert d.detectable == pytest.approx((2.7764 + 0.9410) * 0.70711, abs=1e-3)
    flat = paired_difference([1.0, 0.0, 1.0], [0.0, 1.0, 0.5])
    assert flat.low < 0 < flat.high and not flat.excludes_zero
    one = paired_difference([1.0], [0.25])
    assert one.mean == 0.75 and math.isnan(one.low) and not one.excludes_zero
    with pytest.raises(ValueError, match="need paired values"):
        paired_difference([1.0, 2.0], [0.0])


def test_sample_diversity_by_hand():
    # prompt 0: three different texts ("A b" is not "a b"), alike as lower-cased words; prompt 1: one answer
    d = sample_diversity([["a b", "A b", "c d"], ["a b", "a b", "a b"]])
    assert d["duplicate_share"] == pytest.approx((0 + 2 / 3) / 2)
    assert d["mode_share"] == pytest.approx((1 / 3 + 1) / 2)
    assert d["top_completion_share"] == pytest.approx(4 / 6)
    assert d["distinct_1"] == pytest.approx((4 / 6 + 2 / 6) / 2)  # words are lower-cased: a b a b c d
    assert d["distinct_2"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert d["bigram_entropy_bits"] == pytest.approx(-(5 / 6 * math.log2(5 / 6) + 1 / 6 * math.log2(1 / 6)))
    # every sample different: no duplicates, a prompt's mode is one sample of its n
    d = sample_diversity([["x y", "y z", "z x", "x x"]])
    assert d["duplicate_share"] == 0 and d["mode_share"] == d["top_completion_share"] == 0.25
    # whitespace does not make two answers; one sample a prompt has no mode share; no samples is an error
    assert sample_diversity([["x  y", "x y "]])["mode_share"] == 1
    d = sample_diversity([["x y"], ["x y"]])
    assert d["mode_share"] is None and d["top_completion_share"] == 1 and d["duplicate_share"] == 0
    with pytest.raises(ValueError, match="at least one sample for every prompt"):
        sample_diversity([["x"], []])
