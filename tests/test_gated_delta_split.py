"""The gated delta rule over a sequence split by position over chips (`mercury_kernels/gated_delta/split.py`).

- A span's affine state map (S -> M S + C) against the float64 loop: M the product of the per-token maps
  e^g (I - beta k k^T) written out, C the span's final state from zero, and M S0 + C the loop's final state from S0;
  a document start inside the span zeroes M. Tolerance 1e-5 relative (fp32 chunked algebra against float64).
- On 8 CPU devices, a row split over 2 and 4 chips of a `sequence` axis gives the unsplit rule's outputs and final
  state (fp32, 1e-5 relative: the same algebra, the entering state composed in another order) and its gradients
  with respect to q, k, v, g, beta and the initial state, with packed documents that start exactly on, just before
  and just after a chip boundary; for the chunked form (2 and 4 chips) and the Pallas kernel (interpret mode, 4).
- The model's zig-zag order (chip c holds spans c and 2n - 1 - c of 2n, `span_table`): the same equality on 2 and
  4 chips, the inputs permuted into that order on the host and the outputs back.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gated_delta_cases import make_inputs, naive_gated_delta, segments
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mercury_kernels.gated_delta import gated_delta_rule
from mercury_kernels.gated_delta.split import span_state_map, split_gated_delta_rule


def test_the_span_map_is_the_product_of_the_token_maps():
    x = make_inputs(0, batch=2, time=12, heads=2, key_dim=8, value_dim=6)
    x["g"] = np.maximum(x["g"], -2.0)  # keep M well away from zero, so the comparison is of something
    ids = segments([[12], [5, 7]], [[0], [0, 1]])  # row 1: a document starts at position 5
    M, C = span_state_map(*(jnp.asarray(x[n]) for n in ("k", "g", "beta", "v")), segment_ids_BxT=jnp.asarray(ids),
                          impl="chunked", chunk_size=4)
    for b in range(2):
        for h in range(2):
            want_M = np.eye(8)
            for t in range(12):
                if b == 1 and t == 5:
                    want_M = np.zeros((8, 8))
                kt = x["k"][b, t, h].astype(np.float64)
                step = np.exp(np.float64(x["g"][b, t, h])) * (np.eye(8) - x["beta"][b, t, h] * np.outer(kt, kt))
                want_M = step @ want_M
            np.testing.assert_allclose(M[b, h], want_M, rtol=1e-5, atol=1e-6)
    _, from_zero = naive_gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], segment_ids=ids)
    np.testing.assert_allclose(C, from_zero, rtol=1e-5, atol=1e-5)
    _, from_s0 = naive_gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], ids)
    affine = np.einsum("bhij,bhjv->bhiv", np.asarray(M, np.float64), x["initial_state"]) + np.asarray(C)
    np.testing.assert_allclose(affine, from_s0, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(M)[1] == 0)


def _split(fn, chips):
    mesh = Mesh(np.array(jax.devices()[:chips]), ("sequence",))
    row, whole = P(None, "sequence"), P()
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(row,) * 5 + (whole, row),
                                 out_specs=(row, whole), check_vma=False))


def _zigzag(chips):
    c = np.arange(chips)
    return np.stack([c, 2 * chips - 1 - c], axis=1)


@pytest.mark.parametrize("chips,impl,zigzag", [(2, "chunked", False), (4, "chunked", False), (4, "pallas", False),
                                               (2, "chunked", True), (4, "chunked", True)])
def test_a_split_row_equals_the_unsplit_rule_values_and_gradients(chips, impl, zigzag):
    T = 32
    span = T // (2 * chips) if zigzag else T // chips
    x = make_inputs(1, batch=3, time=T, heads=2, key_dim=16, value_dim=8)
    # row 0: one document; row 1: documents start on a boundary and just after another; row 2: just before one
    ids = segments([[T], [span, 1, T - span - 1], [span - 1, T - span + 1]], [[0], [0, 1, 2], [0, 1]])
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")] + [jnp.asarray(ids)]

    def unsplit(q, k, v, g, beta, s0, seg):
        return gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=s0, segment_ids_BxT=seg, impl=impl,
                                chunk_size=4)

    table = _zigzag(chips) if zigzag else None
    # position p of the split order holds row position perm[p]: span table.flat[p // span], offset p % span
    perm = np.arange(T) if table is None else (table.reshape(-1)[:, None] * span + np.arange(span)).reshape(-1)
    back = np.argsort(perm)
    sharded = _split(lambda q, k, v, g, beta, s0, seg: split_gated_delta_rule(
        q, k, v, g, beta, axis="sequence", span_table=table, initial_state_BxHxKxV=s0, segment_ids_BxT=seg,
        impl=impl, chunk_size=4), chips)

    def split(q, k, v, g, beta, s0, seg):
        o, s = sharded(*(a[:, perm] for a in (q, k, v, g, beta)), s0, seg[:, perm])
        return o[:, back], s
    (want_o, want_s), (got_o, got_s) = unsplit(*args), split(*args)
    np.testing.assert_allclose(got_o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-5)

    cot_o = jnp.asarray(np.random.RandomState(2).randn(*want_o.shape), jnp.float32)
    cot_s = jnp.asarray(np.random.RandomState(3).randn(*want_s.shape), jnp.float32)

    def loss(fn, *a):
        o, s = fn(*a, args[-1])
        return jnp.sum(o * cot_o) + jnp.sum(s * cot_s)
    want_g = jax.grad(lambda *a: loss(unsplit, *a), argnums=tuple(range(6)))(*args[:6])
    got_g = jax.jit(jax.grad(lambda *a: loss(split, *a), argnums=tuple(range(6))))(*args[:6])
    for name, g_got, g_want in zip(("q", "k", "v", "g", "beta", "s0"), got_g, want_g, strict=True):
        scale = float(jnp.max(jnp.abs(g_want)))
        np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
