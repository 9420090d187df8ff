"""Activation sharding at block edges (parallel/sharding.py `constrain`): traced under a role's mesh, the model pins
its residual stream (rows over the row axes) and its attention / GDN heads (over tensor) by logical names; outside
a mesh, inside `shard_map` and on one device it adds nothing; the constraints never change a value."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from mercury_jax.parallel import BATCH_LENGTH_EMBED, constrain, make_mesh, shard_params, with_mesh_context
from models.qwen35_moe.config import tiny
from models.qwen35_moe.model import Qwen35MoeForCausalLM

ROWS, LENGTH = 4, 8
CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ <@mesh, \[(.*?)\]>")


def _model():
    return Qwen35MoeForCausalLM(tiny(vocab_size=64, num_hidden_layers=4, dtype="float32"), rngs=nnx.Rngs(0))


def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def _constraint_specs(mesh, model, ids) -> list[str]:
    graphdef, state = nnx.split(model)
    fn = jax.jit(with_mesh_context(lambda s, x: _forward(graphdef, s, x), mesh))
    return CONSTRAINT.findall(fn.lower(state, ids).as_text())


def test_block_edges_and_heads_are_pinned_on_the_mesh():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = shard_params(_model(), mesh)
    ids = jnp.arange(ROWS * LENGTH, dtype=jnp.int32).reshape(ROWS, LENGTH) % 64
    specs = _constraint_specs(mesh, model, ids)
    rows_only = '{"data", "fsdp"}, {}, {}'
    heads = '{"data", "fsdp"}, {}, {"tensor"}, {}'
    # embedding + 3 per layer for the scanned block of 4 layers (traced once) = 13 residual-stream constraints;
    # attention q, k, v and GDN q, k, v, z (3 GDN layers) = 3 + 12 head constraints
    assert specs.count(rows_only) == 13, specs
    assert specs.count(heads) == 15, specs
    assert len(specs) == 28


def test_nothing_is_added_off_mesh_or_on_one_device():
    model = _model()
    ids = jnp.zeros((ROWS, LENGTH), jnp.int32)
    graphdef, state = nnx.split(model)
    assert CONSTRAINT.findall(jax.jit(lambda s, x: _forward(graphdef, s, x)).lower(state, ids).as_text()) == []
    one = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    assert _constraint_specs(one, model, ids) == []


def test_rows_that_do_not_divide_the_row_shards_stay_whole():
    mesh = make_mesh({"data": 2, "fsdp": 4})
    x = jnp.ones((3, LENGTH, 16))
    lowered = jax.jit(with_mesh_context(lambda v: constrain(v, BATCH_LENGTH_EMBED) * 2, mesh)).lower(x).as_text()
    assert CONSTRAINT.findall(lowered) == ["{}, {}, {}"]


def test_inside_shard_map_the_constraint_steps_aside():
    mesh = make_mesh({"fsdp": 8})

    def per_shard(x):
        return constrain(x, BATCH_LENGTH_EMBED) + 1

    fn = jax.shard_map(per_shard, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    out = jax.jit(with_mesh_context(fn, mesh))(jnp.zeros((8, 2, 4)))
    np.testing.assert_array_equal(np.asarray(out), 1.0)


def test_the_constraints_change_no_value():
    """Same logits with and without the mesh context (fp32; only the partitioning of the sums may differ)."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = shard_params(_model(), mesh)
    ids = (jnp.arange(ROWS * LENGTH, dtype=jnp.int32).reshape(ROWS, LENGTH) * 7) % 64
    graphdef, state = nnx.split(model)
    plain = jax.jit(lambda s, x: _forward(graphdef, s, x))(state, ids)
    pinned = jax.jit(with_mesh_context(lambda s, x: _forward(graphdef, s, x), mesh))(state, ids)
    np.testing.assert_allclose(np.asarray(pinned), np.asarray(plain), rtol=1e-5, atol=1e-5)
