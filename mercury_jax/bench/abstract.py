"""A run's arrays as abstract shapes laid out where the trainer and the engine lay them out: what the ahead-of-time
benches lower programs from, with nothing allocated (every leaf a `jax.ShapeDtypeStruct` with its sharding)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mercury_jax.parallel import variable_sharding
from mercury_jax.rollout.layout import rollout_dtype, row_shardings, state_shardings
from mercury_jax.rollout.sampler import MAX_STOP_IDS, empty_state
from mercury_jax.train.placement import batch_sharding
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe.config import PRESETS


def abstract_state(module_fn, mesh, trainable):
    """(graphdef, params, frozen) of the module with every leaf a ShapeDtypeStruct in its sharding on `mesh`."""
    model = nnx.eval_shape(module_fn)
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        variable.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                sharding=variable_sharding(path, variable, mesh)))
    return nnx.split(model, trainable, ...)


def abstract_opt_state(tx, params, mesh):
    """The optimiser state's shapes laid out as the trainer's eager `tx.init` on sharded parameters lays them out:
    a moment (mu, nu) like the parameter it mirrors (its path ends with that parameter's path), anything else (step
    counts) replicated over the mesh (`placement.onto_mesh`). A jitted init would replicate the moments: its
    zeros depend on no input, so nothing propagates the parameters' layout to them."""
    by_path = {jax.tree_util.keystr(path): leaf.sharding for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_param(path, shape):
        key = jax.tree_util.keystr(path)
        sharding = next((s for p, s in by_path.items() if key.endswith(p)), replicated)
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(like_param, jax.eval_shape(tx.init, params))


def shardings(tree):
    """Each leaf's sharding, in the tree's structure (a step's `state_shardings`)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def batch_spec(mesh, rows: int, seq: int, keys: dict, section) -> dict:
    """The learner batch as sharded shapes; a packed one (`pack_rows`) also carries segment ids and the index maps
    between the packed and the padded layout, as the trainers' batches do (train/packing.py)."""
    if section.get("pack_rows"):
        keys = dict(keys, segment_ids=jnp.int32, unpack_index=jnp.int32, pack_index=jnp.int32)
    sharding = batch_sharding(mesh, (rows, seq))
    return {k: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding) for k, dtype in keys.items()}


def abstract_model(preset: str) -> nnx.Module:
    """The preset's model (fp32 params) as abstract shapes: nothing allocated."""
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32")
    return nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))


def laid_out(state: nnx.State, mesh) -> nnx.State:
    """`state`'s variables as ShapeDtypeStructs laid out on `mesh` by their logical names."""
    return nnx.from_flat_state([
        (path, v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=variable_sharding(path, v, mesh))))
        for path, v in nnx.to_flat_state(state)])


def abstract_engine(model: nnx.Module, slots: int, max_length: int, param_dtype, mesh=None, device=None):
    """(graphdef, params cast to `param_dtype`, decode state, one slot's row, the cast params and the state's
    shapes unplaced), every array abstract and laid out as an engine lays it out: on a replica's `mesh`
    (`rollout/layout.py`), or whole on one `device` (an engine without a mesh)."""
    graphdef, state = nnx.split(model)
    cast = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, rollout_dtype(a.dtype, param_dtype)), state)
    shapes = jax.eval_shape(lambda: empty_state(model.init_cache, slots, max_length))
    row = jax.eval_shape(lambda: model.init_cache(1, max_length))
    if mesh is not None:
        params, state_sh, row_sh = laid_out(cast, mesh), state_shardings(shapes, mesh), row_shardings(row, mesh)
    else:
        one = SingleDeviceSharding(device)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), cast)
        state_sh, row_sh = jax.tree.map(lambda _: one, shapes), jax.tree.map(lambda _: one, row)
    placed = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sh)
    return graphdef, params, placed(shapes, state_sh), placed(row, row_sh), cast, shapes


def prefill_inputs(tokens: int, sharding) -> tuple:
    """(ids [1, tokens], length, request) of one `Sampler.prefill` call, abstract, on `sharding` (replicated)."""
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=sharding)  # noqa: E731
    request = {"reset": scalar(bool), "limit": scalar(jnp.int32), "request_id": scalar(jnp.int32),
               "seed": scalar(jnp.int32), "temperature": scalar(jnp.float32), "top_k": scalar(jnp.int32),
               "top_p": scalar(jnp.float32),
               "stop_ids": jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32, sharding=sharding)}
    return jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=sharding), scalar(jnp.int32), request
