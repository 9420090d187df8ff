"""The token embedding under a mesh (models/qwen35_moe/embedding.py): per shard, the ids of a device's fsdp group are
gathered, looked up in the local table shard and the column slices exchanged by all_to_all, so no collective carries
every token. Values and the table's gradient equal `jnp.take` on one device (exact: a lookup and a scatter-add)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from tolerances import METRIC_C, rounding

from mercury_jax.parallel import make_mesh, with_mesh_context
from mercury_jax.parallel.sharding import logical_partition_spec
from models.qwen35_moe.embedding import TABLE, embed_tokens

V, H, B, T = 24, 16, 8, 5


def _loss(table, ids, probe):
    return jnp.sum(embed_tokens(table, ids, jnp.float32) * probe)


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 4, "expert": 2}, {"tensor": 8},
                                  {"data": 8}])
def test_lookup_and_its_gradient_equal_take_on_a_mesh(axes):
    r = np.random.RandomState(0)
    table = jnp.asarray(r.randn(V, H), jnp.float32)
    ids = jnp.asarray(r.randint(0, V, (B, T)), jnp.int32)
    probe = jnp.asarray(r.randn(B, T, H), jnp.float32)
    want_value, want_grad = jax.value_and_grad(_loss)(table, ids, probe)
    mesh = make_mesh(axes)
    table_on = jax.device_put(table, NamedSharding(mesh, logical_partition_spec(TABLE, table.shape, mesh)))
    rows = NamedSharding(mesh, PartitionSpec(tuple(a for a in ("data", "fsdp", "expert") if a in axes) or None))
    ids_on, probe_on = jax.device_put(ids, rows), jax.device_put(probe, rows)
    fn = with_mesh_context(jax.value_and_grad(_loss), mesh)
    value, grad = jax.jit(fn)(table_on, ids_on, probe_on)
    # the probe sum has terms of both signs (sum |terms| ~ 27 |sum|): its rounding scales with sum |terms|
    magnitude = float(jnp.sum(jnp.abs(jnp.take(table, ids, axis=0) * probe)))
    np.testing.assert_allclose(value, want_value, rtol=0, atol=METRIC_C * rounding(probe.size) * magnitude)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(fn)(table_on, ids_on, probe_on))
    assert "shard_map" in jaxpr
    if axes.get("fsdp", 1) > 1:
        assert "all_to_all" in jaxpr


def test_off_a_mesh_it_is_take():
    table = jnp.arange(V * H, dtype=jnp.float32).reshape(V, H)
    ids = jnp.asarray([[3, 0, 23]], jnp.int32)
    np.testing.assert_array_equal(embed_tokens(table, ids, jnp.bfloat16), table[ids].astype(jnp.bfloat16))
    assert "shard_map" not in str(jax.make_jaxpr(lambda t, i: embed_tokens(t, i, jnp.float32))(table, ids))
