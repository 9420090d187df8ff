"""The decode attention kernel over the carried K/V stack (`mercury_kernels/cached_attention`, interpret mode here).

- Its (max, sum, unnormalised output) equal `split_kv_attention._partial_softmax` over the same layer's slice (fp32,
  1e-5 relative to the largest value: online softmax over blocks rescales the running sums, another rounding order),
  for rows that see nothing, part of a block, several blocks and the whole span; a row that sees nothing gives
  -inf, 0, 0 as the reference does; one and two query tokens per row; a single-layer cache (`x[None]`, layer 0).
- `cached_partial_softmax` takes the kernel only when tracing for TPU with few query rows, and the XLA slice path
  otherwise (a prefill); both give the same triple.
- Block sizes: the largest power of two up to the preferred size that divides the span, else the whole span.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mercury_kernels.cached_attention import MAX_ROWS, block_positions, pallas_cached_partial_softmax
from models.qwen35_moe import split_kv_attention
from models.qwen35_moe.split_kv_attention import _partial_softmax, cached_partial_softmax


def _case(L, B, S, K, G, T, D, seed=0):
    rng = np.random.RandomState(seed)
    return (jnp.asarray(rng.randn(B, T, K, G, D), jnp.float32), jnp.asarray(rng.randn(L, B, S, K, D), jnp.float32),
            jnp.asarray(rng.randn(L, B, S, K, D), jnp.float32))


def _reference(q, keys, values, layer, limit_B):
    S, T = keys.shape[2], q.shape[1]
    visible = jnp.broadcast_to((jnp.arange(S)[None, :] < limit_B[:, None])[:, None, :], (len(limit_B), T, S))
    return _partial_softmax(q, keys[layer], values[layer], visible)


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w))
        finite = np.where(np.isfinite(w), w, 0.0)
        np.testing.assert_allclose(np.where(np.isfinite(g), g, 0.0), finite, rtol=1e-5,
                                   atol=1e-5 * float(np.max(np.abs(finite)) + 1e-30))


@pytest.mark.parametrize("T", [1, 2])
def test_the_kernel_equals_the_partial_softmax_of_the_layer(T):
    q, keys, values = _case(L=3, B=5, S=64, K=2, G=4, T=T, D=128)
    limit_B = jnp.asarray([0, 5, 16, 40, 64], jnp.int32)  # nothing; part of a block; one block; 2.5; all 4
    got = pallas_cached_partial_softmax(q, keys, values, jnp.int32(2), limit_B, block_s=16)
    want = _reference(q, keys, values, 2, limit_B)
    _assert_same(got, want)
    assert np.all(np.isneginf(got[0][0])) and np.all(got[1][0] == 0) and np.all(got[2][0] == 0)


def test_a_single_layer_cache_and_limits_past_the_span():
    q, keys, values = _case(L=1, B=2, S=24, K=1, G=8, T=1, D=128, seed=3)
    limit_B = jnp.asarray([-3, 99], jnp.int32)  # a span after the row's tokens; one wholly before them
    got = pallas_cached_partial_softmax(q, keys[0][None], values[0][None], jnp.int32(0), limit_B, block_s=8)
    _assert_same(got, _reference(q, keys, values, 0, jnp.clip(limit_B, 0, 24)))


def test_the_dispatch_takes_the_kernel_for_a_decode_on_tpu_only(monkeypatch):
    q, keys, values = _case(L=2, B=3, S=32, K=2, G=4, T=1, D=128, seed=5)
    limit_B = jnp.asarray([3, 17, 32], jnp.int32)
    want = _reference(q, keys, values, 1, limit_B)
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return pallas_cached_partial_softmax(*args, **kwargs, interpret=True)
    monkeypatch.setattr(split_kv_attention, "pallas_cached_partial_softmax", spy)
    _assert_same(cached_partial_softmax(q, keys, values, jnp.int32(1), limit_B), want)
    assert calls == []  # CPU: the XLA path
    monkeypatch.setattr(split_kv_attention, "target_platform", lambda: "tpu")
    _assert_same(cached_partial_softmax(q, keys, values, jnp.int32(1), limit_B), want)
    assert calls == [q.shape]
    long_q = jnp.tile(q, (1, MAX_ROWS, 1, 1, 1))  # a prefill's rows: the XLA path even on TPU
    cached_partial_softmax(long_q, keys, values, jnp.int32(1), limit_B)
    assert calls == [q.shape]


def test_block_sizes():
    assert block_positions(6144) == 512 and block_positions(6144, 1024) == 1024
    assert block_positions(96, 512) == 32 and block_positions(24, 512) == 8 and block_positions(7, 512) == 7


@pytest.mark.parametrize("T", [1, 5])
def test_a_split_replica_with_the_kernel_equals_the_whole_cache(monkeypatch, T):
    """The split-K/V attention of one layer of a stacked cache on tensor=4 with the kernel taking the cached span
    (interpret mode, as the dispatch would on TPU) equals the whole-cache path, 1e-6 as without the kernel."""
    import jax

    from mercury_jax.parallel import make_mesh, with_mesh_context
    from models.qwen35_moe.attention import whole_kv_cached_attention
    from models.qwen35_moe.split_kv_attention import split_kv_cached_attention

    monkeypatch.setattr(split_kv_attention, "target_platform", lambda: "tpu")
    calls = []
    monkeypatch.setattr(split_kv_attention, "pallas_cached_partial_softmax",
                        lambda *a, **k: calls.append(1) or pallas_cached_partial_softmax(*a, **k, interpret=True))
    mesh = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    rng = np.random.RandomState(11)
    B, S, K, N, D = 5, 48, 1, 4, 8
    arr = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)  # noqa: E731
    starts = jnp.asarray([0, 11, 12, 13, 40], jnp.int32)
    write_BxT = starts[:, None] + jnp.arange(T)[None, :]
    query, key, value = arr(B, T, N, D), arr(B, T, K, D), arr(B, T, K, D)
    cache = {"k": arr(B, S, K, D), "v": arr(B, S, K, D)}
    stack = {name: jnp.stack([-cache[name], cache[name]]) for name in ("k", "v")}
    want_out, want_cache = whole_kv_cached_attention(query, key, value, cache, write_BxT, write_BxT)
    split = jax.jit(with_mesh_context(lambda *a: split_kv_cached_attention(*a, mesh), mesh))
    got_out, got_stack = split(query, key, value, dict(stack, layer=jnp.int32(1)), write_BxT, write_BxT)
    np.testing.assert_allclose(got_out, want_out, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(got_stack["k"][1], want_cache["k"])
    np.testing.assert_array_equal(got_stack["k"][0], stack["k"][0])
    assert calls, "the kernel was not taken"
