"""The density experiment's measures: how diverse a policy's samples are, and paired differences over
seeds with Student-t intervals.

Each seed is one paired observation (both arms share its data, SFT model and prompts), so the
interval is the one-sample t interval of the per-seed differences: mean +- t_{n-1, 0.975} * s / sqrt(n).
The t quantile is computed here (bisection on the t CDF, itself a numerical integral of the density)
so the project needs no scipy.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass


def ngrams(tokens: list[str], n: int) -> list[tuple]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def sample_diversity(samples: list[list[str]]) -> dict[str, float | None]:
    """Diversity and collapse measures of sampled completions, one list of texts per prompt.

    distinct_n: unique n-grams / n-grams within each prompt's samples (lower-cased words), averaged over
    prompts; bigram_entropy_bits: entropy of the bigram counts over all samples; duplicate_share: the
    share of a prompt's samples that repeat another of its samples exactly; mode_share: the share of a
    prompt's samples equal to its most common one (1/n when all differ, 1 when all are one answer; None
    with one sample a prompt, where it is 1 by definition); top_completion_share: the share of all samples
    equal to the single most common completion (one answer for every prompt: the reward-hacking signature).
    Texts are compared with their whitespace normalised."""
    if not samples or not all(samples):
        raise ValueError("sample_diversity needs at least one sample for every prompt")
    samples = [[" ".join(t.split()) for t in texts] for texts in samples]
    words = [[t.lower().split() for t in texts] for texts in samples]
    distinct = {n: sum(len(set(g)) / max(len(g), 1) for g in ([x for t in w for x in ngrams(t, n)] for w in words))
                / len(words) for n in (1, 2)}
    bigrams = Counter(x for w in words for t in w for x in ngrams(t, 2))
    total = sum(bigrams.values())
    every = [t for texts in samples for t in texts]
    return {"distinct_1": distinct[1], "distinct_2": distinct[2],
            "bigram_entropy_bits": -sum(c / total * math.log2(c / total) for c in bigrams.values()) if total else 0.0,
            "duplicate_share": sum((len(t) - len(set(t))) / len(t) for t in samples) / len(samples),
            "mode_share": None if min(map(len, samples)) < 2 else
            sum(Counter(t).most_common(1)[0][1] / len(t) for t in samples) / len(samples),
            "top_completion_share": Counter(every).most_common(1)[0][1] / len(every)}


def t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """P(T <= x) for Student's t with df degrees of freedom (Simpson's rule on the density from 0)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df, steps)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)  # noqa: E731
    h = x / steps
    area = f(0) + f(x) + sum((4 if k % 2 else 2) * f(k * h) for k in range(1, steps))
    return 0.5 + area * h / 3


@functools.cache  # a report asks for the same one per metric and arm: 60 bisection steps of 4000-point integrals each
def t_quantile(p: float, df: int) -> float:
    """The x with t_cdf(x, df) = p, for 0.5 <= p < 1."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass
class PairedDifference:
    """Per-seed differences (arm minus baseline) summarised: mean, 95% t interval, and the smallest
    true difference this many seeds would detect with 80% power at the 5% level."""
    diffs: list[float]
    mean: float
    low: float
    high: float
    half_width: float
    detectable: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_difference(arm: list[float], baseline: list[float]) -> PairedDifference:
    """One seed gives the difference only (interval NaN)."""
    if len(arm) != len(baseline) or not arm:
        raise ValueError(f"need paired values, got {len(arm)} and {len(baseline)}")
    diffs = [a - b for a, b in zip(arm, baseline)]
    n = len(diffs)
    mean = sum(diffs) / n
    if n == 1:
        return PairedDifference(diffs, mean, math.nan, math.nan, math.nan, math.nan)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    detectable = (t_quantile(0.975, n - 1) + t_quantile(0.8, n - 1)) * se
    return PairedDifference(diffs, mean, mean - half, mean + half, half, detectable)
