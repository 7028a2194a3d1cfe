"""Paired differences over seeds with Student-t intervals, for the density experiment's report.

Each seed is one paired observation (both arms share its data, SFT model and prompts), so the
interval is the one-sample t interval of the per-seed differences: mean +- t_{n-1, 0.975} * s / sqrt(n).
The t quantile is computed here (bisection on the t CDF, itself a numerical integral of the density)
so the project needs no scipy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """P(T <= x) for Student's t with df degrees of freedom (Simpson's rule on the density from 0)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df, steps)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)  # noqa: E731
    h = x / steps
    area = f(0) + f(x) + sum((4 if k % 2 else 2) * f(k * h) for k in range(1, steps))
    return 0.5 + area * h / 3


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
