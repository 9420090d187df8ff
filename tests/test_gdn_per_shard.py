"""The Pallas gated delta kernel under a mesh (`parallel.per_shard`): XLA cannot partition a Mosaic call, so the GDN
layer runs it in a `shard_map` per shard (rows over the row axes, heads over tensor). Values and gradients equal the
pure-JAX chunked form off the mesh; the per-shard call is there only for the Pallas kernel and only on a mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mercury_jax.parallel import make_mesh, per_shard, shard_params, with_mesh_context
from models.qwen35_moe.config import tiny
from models.qwen35_moe.gated_deltanet import GatedDeltaNet

ROWS, LENGTH = 4, 24


def _rowwise(x_BxTxH, scale_BxH):
    return jnp.cumsum(x_BxTxH, axis=1) * scale_BxH[:, None, :]


def test_per_shard_equals_the_call_and_splits_by_names():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    x = jnp.arange(4 * 5 * 6, dtype=jnp.float32).reshape(4, 5, 6)
    scale = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6) / 7
    names = (("activation_batch", "activation_length", "linear_value_heads"),
             ("activation_batch", "linear_value_heads"))

    def run(x, scale):
        return per_shard(_rowwise, (x, scale), names, names[0])

    on_mesh = jax.jit(with_mesh_context(run, mesh))  # the arrays live on the mesh, as a trainer's do
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    np.testing.assert_array_equal(on_mesh(*jax.device_put((x, scale), replicated)), _rowwise(x, scale))
    jaxpr = str(jax.make_jaxpr(with_mesh_context(run, mesh))(x, scale))
    assert jaxpr.count("shard_map") == 1
    assert "P(('data', 'fsdp'), None, 'tensor')" in jaxpr and "P(('data', 'fsdp'), 'tensor')" in jaxpr, jaxpr
    assert "shard_map" not in str(jax.make_jaxpr(run)(x, scale))  # off a mesh: the plain call


def test_per_shard_passes_none_arguments_through():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

    def fn(x, nothing):
        assert nothing is None
        return x * 2

    x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    out = jax.jit(with_mesh_context(lambda x: per_shard(fn, (x, None), (("activation_batch",), None),
                                                        ("activation_batch",)), mesh))(x)
    np.testing.assert_array_equal(out, jnp.arange(8.0) * 2)


def _layer(gdn_impl):
    config = tiny(vocab_size=64, dtype="float32", gdn_chunk_size=8, gdn_impl=gdn_impl)
    return GatedDeltaNet(config, rngs=nnx.Rngs(0))


def _loss(graphdef, state, x, segments):
    out, _ = nnx.merge(graphdef, state)(x, segment_ids_BxT=segments)
    return jnp.mean(jnp.square(out))


@pytest.mark.slow
def test_pallas_gdn_layer_on_a_mesh_equals_chunked_off_mesh():
    """fp32; the kernel in interpret mode, per shard, against the chunked form on one device: loss 1e-5 and
    gradients (inputs and every parameter) 1e-4 relative, the two f32 chunk algebras' agreement in
    test_gated_delta_pallas. Segments change at 10 (off a chunk edge) and 16 (on one)."""
    x = jax.random.normal(jax.random.key(1), (ROWS, LENGTH, 64), jnp.float32)
    segments = (jnp.arange(LENGTH)[None, :] >= 10).astype(jnp.int32) + (jnp.arange(LENGTH)[None, :] >= 16)
    segments = jnp.broadcast_to(segments, (ROWS, LENGTH))
    graphdef, state = nnx.split(_layer("chunked"))
    want_loss, want_grads = jax.value_and_grad(_loss, argnums=(1, 2))(graphdef, state, x, segments)

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    p_graphdef, p_state = nnx.split(shard_params(_layer("pallas"), mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x_on, segments_on = jax.device_put((x, segments), replicated)

    def loss(s, x, seg):
        return _loss(p_graphdef, s, x, seg)

    got_loss, got_grads = jax.jit(with_mesh_context(jax.value_and_grad(loss, argnums=(0, 1)), mesh))(
        p_state, x_on, segments_on)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    jaxpr = str(jax.make_jaxpr(with_mesh_context(loss, mesh))(p_state, x_on, segments_on))
    assert jaxpr.count("shard_map[") == 1, "the Pallas GDN call is not wrapped per shard"
    assert "P(('data', 'fsdp'), None, 'tensor', None)" in jaxpr  # rows over data x fsdp, value heads over tensor
    chunked_jaxpr = str(jax.make_jaxpr(with_mesh_context(lambda s, x, seg: _loss(graphdef, s, x, seg), mesh))(
        state, x, segments))
    assert "shard_map[" not in chunked_jaxpr  # the pure-JAX form is left to GSPMD
