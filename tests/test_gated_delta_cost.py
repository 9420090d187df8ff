"""The blocked chunked gated delta rule: exact across block boundaries, and no intermediate that outgrows the inputs.

Tolerances as in test_gated_delta.py: float32 kernels against a float64 loop on contractive updates; observed errors
are ~1e-7 to 3e-7, and 1e-5 leaves headroom while a wrong block carry gives O(0.1) errors.
"""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from gated_delta_cases import make_inputs, naive_gated_delta, segments

from mercury_kernels.gated_delta.chunked import block_layout, chunked_gated_delta_rule

NAMES = ("q", "k", "v", "g", "beta")


@pytest.mark.parametrize("time,block_chunks", [(37, 1), (64, 2), (130, 3)])
@pytest.mark.parametrize("with_segments", [False, True])
def test_many_blocks_match_naive_loop(time, block_chunks, with_segments):
    """Chunk 8 and 1-3 chunks per block: 2-17 blocks, documents starting at block edges, chunk edges and inside."""
    x = make_inputs(time, batch=2, time=time, heads=2, key_dim=8, value_dim=8)
    segment_ids = None
    if with_segments:
        first = [8, 16, time - 24] if time > 24 else [8, time - 8]  # starts at 8 (chunk edge) and 24 (block edge)
        second = [5, time - 5]  # a start inside the first chunk
        segment_ids = segments([first, second], [list(range(len(first))), [3, 3 + 1]])
    run = jax.jit(lambda *a: chunked_gated_delta_rule(*a[:5], initial_state_BxHxKxV=a[5], segment_ids_BxT=a[6],
                                                      chunk_size=8, block_chunks=block_chunks))
    out, final = run(*(x[n] for n in NAMES), x["initial_state"], segment_ids)
    want_out, want_final = naive_gated_delta(*(x[n] for n in NAMES), x["initial_state"], segment_ids)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-5)


def test_many_blocks_gradients_match_one_block():
    """Checkpointed blocks change only what the backward pass stores, not the gradients (fp32 sums: 1e-5)."""
    x = make_inputs(3, batch=1, time=50, heads=2, key_dim=4, value_dim=4)
    segment_ids = segments([[20, 30]], [[0, 1]])
    weight = np.random.default_rng(4).normal(size=(1, 50, 2, 4)).astype(np.float32)

    def loss(block_chunks, *args):
        out, final = chunked_gated_delta_rule(*args[:5], initial_state_BxHxKxV=args[5], segment_ids_BxT=segment_ids,
                                              chunk_size=8, block_chunks=block_chunks)
        return jnp.sum(out * weight) + jnp.sum(jnp.sin(final))

    args = [x[n] for n in NAMES] + [x["initial_state"]]
    many = jax.jit(jax.grad(lambda *a: loss(2, *a), argnums=range(6)))(*args)
    one = jax.jit(jax.grad(lambda *a: loss(100, *a), argnums=range(6)))(*args)
    for name, got, want in zip(NAMES + ("initial_state",), many, one):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def _largest_intermediate(fn, *args):
    """Most elements of any value produced inside the jaxpr of fn(*args), sub-jaxprs (scan, checkpoint) included."""
    def walk(jaxpr):
        sizes = [int(np.prod(v.aval.shape)) for eqn in jaxpr.eqns for v in eqn.outvars if hasattr(v.aval, "shape")]
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        sizes.append(walk(sub.jaxpr))
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        sizes.append(walk(sub))
        return max(sizes, default=0)
    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("with_grad", [False, True])
def test_no_intermediate_grows_faster_than_the_inputs(with_grad):
    """Structural pin of linear cost: with C = 32 > K = V = 8, any C x C quantity formed for all chunks at once
    (C floats per token and head, the old superlinear-in-practice layout) is 4x larger than v; blocked, the C x C
    arrays stay one block's size, so nothing exceeds B T H max(K, V) at any T, forward or backward."""
    batch, heads, dim, chunk, block_chunks = 1, 2, 8, 32, 2
    for time in (256, 1024):
        x = make_inputs(0, batch=batch, time=time, heads=heads, key_dim=dim, value_dim=dim)
        args = [x[n] for n in NAMES]

        def forward(*a):
            return chunked_gated_delta_rule(*a, chunk_size=chunk, block_chunks=block_chunks)

        fn = (jax.grad(lambda *a: sum(jnp.sum(o) for o in forward(*a)), argnums=range(5)) if with_grad else forward)
        num_blocks, per_block = block_layout(-(-time // chunk), block_chunks)
        padded_time = num_blocks * per_block * chunk
        assert _largest_intermediate(fn, *args) <= batch * padded_time * heads * dim, time


def test_block_layout_pads_less_than_one_chunk_per_block():
    for num_chunks in range(1, 80):
        for most in (1, 2, 3, 16):
            blocks, per_block = block_layout(num_chunks, most)
            assert per_block <= most and blocks * per_block >= num_chunks
            assert blocks * per_block - num_chunks < blocks
