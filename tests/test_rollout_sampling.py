"""Sampling rules on hand-made logits: top-k / top-p sets against a numpy reference, greedy, recorded log-probs,
per-token keys.

Tolerance for log-probs 1e-6: same fp32 formula, only the reduction order may differ.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mercury_jax.rollout import sampling
from mercury_jax.rollout.sampling import filter_logits

sample_tokens = jax.jit(sampling.sample_tokens)
token_keys = jax.jit(sampling.token_keys)
N_DRAWS = 20000  # one shape for every many-draw test: one compilation


def allowed_set(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Naive reference: sort, keep k, then the smallest prefix whose renormalised mass reaches p."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    if 0 < top_k < len(logits):
        order = order[:top_k]
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    keep, mass = [], 0.0
    for token, p in zip(order, probs):
        if mass >= top_p:
            break
        keep.append(int(token))
        mass += p
    return set(keep)


LOGITS = np.array([2.0, 0.5, -1.0, 3.0, 1.0, 0.0, -3.0, 2.5, 0.25, -0.5], np.float32)
CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 1, 1.0), (1.0, 0, 0.5), (1.0, 0, 0.8), (0.5, 0, 0.9), (2.0, 4, 0.7),
    (1.0, 5, 0.3), (1.0, 0, 0.01),
]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_filter_keeps_exactly_the_reference_set(temperature, top_k, top_p):
    filtered = np.asarray(filter_logits(jnp.asarray(LOGITS[None]), jnp.asarray([temperature]),
                                        jnp.asarray([top_k]), jnp.asarray([top_p])))[0]
    kept = set(np.nonzero(np.isfinite(filtered))[0].tolist())
    assert kept == allowed_set(LOGITS, temperature, top_k, top_p)
    np.testing.assert_allclose(filtered[list(kept)], LOGITS[list(kept)] / temperature, rtol=1e-6)


# Sorted probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (tokens 1, 3, 0, then 2 and 4 tied): the logits are multiples of
# float32(ln 2), and XLA's float32 softmax of them is exactly these powers of two (asserted below), so the mass before
# each sorted position (0, 1/2, 3/4, 7/8, 15/16) is exact and top_p can equal it exactly.
LN2 = np.float32(np.log(2.0))
POWER_OF_TWO_LOGITS = np.array([-2 * LN2, 0.0, -3 * LN2, -LN2, -3 * LN2], np.float32)


@pytest.mark.parametrize("top_p,kept", [
    (0.5, {1}),           # token 1 alone has mass 1/2 = p: it reaches p, nothing more is needed
    (0.75, {1, 3}),       # 1/2 + 1/4 = p exactly
    (0.875, {1, 3, 0}),   # 7/8 exactly; keeping "mass before <= p" would add the tied tokens 2 and 4
    (0.5000001, {1, 3}),  # just past an exact mass: one more token
])
def test_top_p_stops_at_exact_mass_equality(top_p, kept):
    """The nucleus is the smallest set whose mass reaches p: a token whose preceding mass already equals p is out."""
    probs = np.asarray(jax.nn.softmax(jnp.asarray(POWER_OF_TWO_LOGITS)))
    np.testing.assert_array_equal(probs, [0.125, 0.5, 0.0625, 0.25, 0.0625])  # the exactness this test relies on
    filtered = np.asarray(filter_logits(jnp.asarray(POWER_OF_TWO_LOGITS[None]), jnp.ones(1), jnp.zeros(1, jnp.int32),
                                        jnp.asarray([top_p], jnp.float32)))[0]
    assert set(np.flatnonzero(np.isfinite(filtered)).tolist()) == kept
    np.testing.assert_array_equal(filtered[sorted(kept)], POWER_OF_TWO_LOGITS[sorted(kept)])


def test_rows_use_their_own_parameters():
    """Four rows, four settings, one call: each row matches its own reference set."""
    logits = np.stack([LOGITS, LOGITS[::-1], LOGITS * 2, LOGITS])
    params = [(1.0, 2, 1.0), (1.0, 0, 0.6), (0.7, 0, 1.0), (1.0, 3, 0.5)]
    t, k, p = (jnp.asarray(x) for x in zip(*params))
    filtered = np.asarray(filter_logits(jnp.asarray(logits), t, k, p))
    for row, (temperature, top_k, top_p) in enumerate(params):
        assert set(np.nonzero(np.isfinite(filtered[row]))[0].tolist()) == allowed_set(logits[row], temperature,
                                                                                      top_k, top_p)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 3, 1.0), (1.0, 0, 0.6), (1.5, 4, 0.8)])
def test_sampled_tokens_lie_in_the_allowed_set_and_cover_it(temperature, top_k, top_p):
    n = N_DRAWS
    keys = token_keys(jnp.zeros(n, jnp.int32), jnp.full(n, 3), jnp.arange(n))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, len(LOGITS)))
    tokens, _, sampling_lp = sample_tokens(logits, keys, jnp.full(n, temperature), jnp.full(n, top_k),
                                           jnp.full(n, top_p))
    allowed = allowed_set(LOGITS, temperature, top_k, top_p)
    drawn = set(np.asarray(tokens).tolist())
    assert drawn == allowed  # never outside; with 20k draws every kept token (p >= 1%) shows up
    # the sampling log-prob is the renormalised tempered distribution over the allowed set (float64 reference)
    kept = sorted(allowed)
    scaled = LOGITS[kept].astype(np.float64) / temperature
    log_softmax_kept = dict(zip(kept, scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())))
    np.testing.assert_allclose(np.asarray(sampling_lp), [log_softmax_kept[t] for t in np.asarray(tokens).tolist()],
                               atol=1e-6)


def test_frequencies_follow_the_tempered_distribution():
    """Temperature 2 sampling frequencies vs softmax(logits / 2); 20k draws, 4-sigma bound per token."""
    n = N_DRAWS
    keys = token_keys(jnp.full(n, 5), jnp.zeros(n, jnp.int32), jnp.arange(n))
    tokens, _, _ = sample_tokens(jnp.broadcast_to(jnp.asarray(LOGITS), (n, 10)), keys, jnp.full(n, 2.0),
                                 jnp.zeros(n, jnp.int32), jnp.ones(n))
    expected = np.asarray(jax.nn.softmax(jnp.asarray(LOGITS) / 2))
    freq = np.bincount(np.asarray(tokens), minlength=10) / n
    assert np.all(np.abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / n) + 1e-4)


def test_logprob_is_unscaled_log_softmax_and_sampling_logprob_is_the_filtered_one():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS]))
    keys = token_keys(jnp.zeros(2, jnp.int32), jnp.arange(2), jnp.zeros(2, jnp.int32))
    tokens, lp, slp = sample_tokens(logits, keys, jnp.asarray([0.5, 0.0]), jnp.asarray([3, 0]), jnp.asarray([1.0, 1.0]))
    tokens = np.asarray(tokens)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(lp), ref[[0, 1], tokens], atol=1e-6)
    assert tokens[1] == int(np.argmax(LOGITS)) and float(slp[1]) == 0.0  # greedy row
    top3 = np.argsort(-LOGITS)[:3]
    ref_filtered = np.asarray(jax.nn.log_softmax(jnp.asarray(LOGITS[top3] / 0.5)))
    assert tokens[0] in top3
    np.testing.assert_allclose(float(slp[0]), ref_filtered[list(top3).index(tokens[0])], atol=1e-6)


def test_token_keys_depend_on_seed_request_and_index_only():
    base = np.asarray(token_keys(jnp.asarray([1, 1]), jnp.asarray([7, 7]), jnp.asarray([4, 4])))
    assert np.array_equal(base[0], base[1])
    for seed, rid, idx in ((2, 7, 4), (1, 8, 4), (1, 7, 5)):
        other = np.asarray(token_keys(jnp.asarray([seed]), jnp.asarray([rid]), jnp.asarray([idx])))[0]
        assert not np.array_equal(other, base[0])
