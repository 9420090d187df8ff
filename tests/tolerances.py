"""Tolerances for two float32 programs that compute the same terms and differ only in how they order their sums
(micro-batched vs whole-batch steps, packed vs padded rows, rematerialised vs stored activations).

Two orders of a sum of n float32 terms differ by about sqrt(n) * eps32 * sum |terms| (the probabilistic bound of
Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019; the worst case is n * eps32; eps32 = 2^-23 = 1.2e-7). XLA:CPU picks
the order (tiling, vector width, fusion), so it changes with the host: a test may rely on this bound, never on
what one host's rounding happens to give. Hence, with `rounding(n) = eps32 * sqrt(n)`:

- a quantity whose terms do not cancel (a loss, a metric, the whole gradient: sum |terms| ~ |sum|) agrees to
  c * rounding(n) of its own size;
- a gradient leaf may nearly cancel (the real model's GDN A_log and dt_bias: 3e-6 of the whole gradient's norm), so
  its own norm is no scale for its error. Its terms are per-token contributions like every other leaf's, so its
  scale is its share of the whole gradient, |g| sqrt(leaf size / total size) (the whole norm spread evenly over
  the elements), and it agrees to c * rounding(n) * (|leaf| + |g| sqrt(leaf size / total size)).

c counts the chained sums a value goes through (forward, loss, backward): `METRIC_C` for a loss or metric,
`GRADIENT_C` for gradients. A leaf smaller than its share of the whole gradient is checked only to that absolute
bound (a bug that moves A_log's gradient by under ~1% alone would pass; every step test moves values by > 1e-2).
"""
from __future__ import annotations

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)
METRIC_C = 2.0
GRADIENT_C = 4.0


def rounding(n_terms: int) -> float:
    """eps32 * sqrt(n): the relative difference two summation orders of n non-cancelling float32 terms may show."""
    return EPS32 * float(np.sqrt(n_terms))


def assert_gradients_close(got, want, *, n_terms: int, c: float = GRADIENT_C) -> float:
    """`got` and `want` (pytrees of float32 gradients) agree to the bounds above: the whole gradient to
    c * rounding(n_terms) of its norm, each leaf to c * rounding(n_terms) * (|leaf| + its share of the whole norm).
    Returns the worst error as a fraction of its bound (for reports)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    got_leaves = [np.asarray(x, np.float64) for x in got_leaves]
    want_leaves = [np.asarray(x, np.float64) for x in want_leaves]
    whole = np.sqrt(sum(np.sum(np.square(w)) for w in want_leaves))
    size = sum(w.size for w in want_leaves)
    tol = c * rounding(n_terms)
    error = np.sqrt(sum(np.sum(np.square(g - w)) for g, w in zip(got_leaves, want_leaves)))
    assert error <= tol * whole, f"whole gradient: |got - want| = {error:.3g} > {tol:.3g} x |want| = {whole:.3g}"
    worst = error / (tol * whole) if whole else 0.0
    for index, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        leaf_error, bound = np.linalg.norm(g - w), tol * (np.linalg.norm(w) + whole * np.sqrt(w.size / size))
        assert leaf_error <= bound, (f"gradient leaf {index} {w.shape}: |got - want| = {leaf_error:.3g} > {bound:.3g} "
                                     f"(|want| = {np.linalg.norm(w):.3g}, whole gradient {whole:.3g})")
        worst = max(worst, leaf_error / bound if bound else 0.0)
    return float(worst)
