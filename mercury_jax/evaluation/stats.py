"""Confidence intervals and the paired significance test of the checkpoint sweep.

Wilson score interval of a proportion (k successes in n episodes, p = k / n, z the two-sided normal quantile):

    centre = (p + z^2 / 2n) / (1 + z^2 / n)
    half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

It stays inside [0, 1] and keeps sensible coverage at p near 0 or 1 and small n, where the Wald interval
p +- z sqrt(p (1 - p) / n) collapses to a point (an over-search rate of 0 is a common outcome).

Student-t interval of a mean (tool calls per episode): mean +- t_{n-1, 1 - (1 - confidence) / 2} * s / sqrt(n),
s the sample standard deviation (ddof 1).

Exact McNemar test of two policies on the same tasks. Each task gives a pair (start outcome, candidate outcome) of
booleans; only the discordant pairs carry information about a difference:

    b = #(start 1, candidate 0)        c = #(start 0, candidate 1)        n = b + c

Under H0 (same rate) each discordant pair is equally likely to fall either way, so c ~ Binomial(n, 1/2), and

    two-sided:              p = min(1, 2 * P(X <= min(b, c)))
    candidate lower ("less"):   p = P(X <= c)
    candidate higher ("greater"): p = P(X >= c)

with P(X <= k) = sum_{i <= k} C(n, i) / 2^n computed exactly in integers. The test is paired (the same task
list and sampling seed for every checkpoint), so it is far more sensitive than comparing two independent
proportions: per-task difficulty cancels. No discordant pair (n = 0) gives p = 1.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from statistics import NormalDist

ALTERNATIVES = ("two-sided", "less", "greater")


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of the proportion successes / trials; (0, 1) when there are no trials."""
    if not 0 <= successes <= trials:
        raise ValueError(f"successes {successes} must lie in [0, trials={trials}]")
    if trials == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p, n = successes / trials, trials
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # The interval always contains p; the clamps only undo rounding (k = n gave an upper bound of 1 - 1e-16).
    return max(0.0, min(centre - half, p)), min(1.0, max(centre + half, p))


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean of `values`; a single value gives (value, value): no spread to estimate."""
    from scipy.stats import t as student_t

    n = len(values)
    if n == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, mean
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(student_t.ppf(1 - (1 - confidence) / 2, n - 1)) * std / math.sqrt(n)
    return mean - half, mean + half


def discordant_counts(start: Sequence[bool], candidate: Sequence[bool]) -> tuple[int, int]:
    """(b, c) = (#tasks the start got and the candidate did not, #tasks the candidate got and the start did not)."""
    if len(start) != len(candidate):
        raise ValueError(f"paired outcomes need the same tasks: {len(start)} start vs {len(candidate)} candidate")
    b = sum(1 for s, k in zip(start, candidate) if s and not k)
    c = sum(1 for s, k in zip(start, candidate) if k and not s)
    return b, c


def mcnemar_exact(start: Sequence[bool], candidate: Sequence[bool], alternative: str = "two-sided") -> float:
    """Exact McNemar p-value of the candidate's rate against the start's on paired outcomes (see module doc)."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative {alternative!r} is not one of {ALTERNATIVES}")
    b, c = discordant_counts(start, candidate)
    n = b + c
    if n == 0:
        return 1.0
    if alternative == "two-sided":
        p = 2 * _binomial_half_cdf(min(b, c), n)
    elif alternative == "less":
        p = _binomial_half_cdf(c, n)
    else:  # P(X >= c) = P(X <= n - c) by symmetry of Binomial(n, 1/2)
        p = _binomial_half_cdf(n - c, n)
    return float(min(Fraction(1), p))


def _binomial_half_cdf(k: int, n: int) -> Fraction:
    """P(X <= k) for X ~ Binomial(n, 1/2), exactly."""
    return Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2 ** n)
