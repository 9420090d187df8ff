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
proportions: per-task difficulty cancels. No discordant pair (n = 0) gives p = 1. It is the sign test of the
paired differences candidate - start, which `sign_test` runs on counts and `paired_difference` on real-valued
per-task scores (partial credit), beside the paired t statistic:

    d_i = candidate_i - start_i,   mean d +- t_{n-1} s_d / sqrt(n),   t = mean d / (s_d / sqrt(n)),  n - 1 dof
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
    from scipy.stats import t as student_t  # noqa: PLC0415  (scipy.stats takes ~0.4 s to import)

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
    b, c = discordant_counts(start, candidate)
    return sign_test(c, b, alternative)


def sign_test(wins: int, losses: int, alternative: str = "two-sided") -> float:
    """Exact sign test: `wins` pairs where the candidate is higher, `losses` where it is lower (ties dropped);
    "greater" asks whether the candidate is higher (p = P(X >= wins), X ~ Binomial(wins + losses, 1/2))."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative {alternative!r} is not one of {ALTERNATIVES}")
    if wins < 0 or losses < 0:
        raise ValueError(f"wins {wins} and losses {losses} must be counts")
    n = wins + losses
    if n == 0:
        return 1.0
    if alternative == "two-sided":
        p = 2 * _binomial_half_cdf(min(wins, losses), n)
    elif alternative == "less":
        p = _binomial_half_cdf(wins, n)
    else:  # P(X >= wins) = P(X <= n - wins) by symmetry of Binomial(n, 1/2)
        p = _binomial_half_cdf(n - wins, n)
    return float(min(Fraction(1), p))


def paired_difference(start: Sequence[float], candidate: Sequence[float], confidence: float = 0.95) -> dict:
    """Paired comparison of per-task scores of two policies on the same tasks (and sampling seeds): the mean
    difference candidate - start with its standard error and t interval, the two-sided paired t p-value, and the
    exact sign test of candidate > start (wins, losses, ties)."""
    from scipy.stats import t as student_t  # noqa: PLC0415  (scipy.stats takes ~0.4 s to import)

    if len(start) != len(candidate):
        raise ValueError(f"paired scores need the same tasks: {len(start)} start vs {len(candidate)} candidate")
    if len(start) < 2:
        raise ValueError(f"a paired comparison needs at least 2 tasks, got {len(start)}")
    differences = [float(c) - float(s) for s, c in zip(start, candidate)]
    n = len(differences)
    mean = math.fsum(differences) / n
    sem = math.sqrt(math.fsum((d - mean) ** 2 for d in differences) / (n - 1) / n)
    low, high = mean_interval(differences, confidence)
    p_t = 1.0 if sem == 0 else float(2 * student_t.sf(abs(mean) / sem, n - 1))
    wins, losses = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    return {"num_tasks": n, "start_mean": math.fsum(map(float, start)) / n,
            "candidate_mean": math.fsum(map(float, candidate)) / n, "mean_difference": mean, "sem": sem,
            "ci": [low, high], "confidence": confidence, "p_paired_t": p_t, "wins": wins, "losses": losses,
            "ties": n - wins - losses, "p_sign_greater": sign_test(wins, losses, "greater")}


def _binomial_half_cdf(k: int, n: int) -> Fraction:
    """P(X <= k) for X ~ Binomial(n, 1/2), exactly."""
    return Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2 ** n)
