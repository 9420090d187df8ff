"""Map logical axes (`embed`, `heads`, `experts`, ..., `activation_batch`) to mesh axes: shard model state, and
pin activations at block edges.

A rule table maps each logical name to a mesh axis (or a tuple of them, or None = replicated). A dimension whose
size the mesh axis does not divide is replicated instead (stated in the returned spec, never silently wrong).
Parameters of scanned blocks carry a leading `layers` axis that is not in their metadata; it is added here.
Activations name their dims the same way (`constrain`): rows over the row axes (data, fsdp, expert), heads over
tensor, the residual stream's hidden dim replicated, so XLA does not invent layouts between blocks.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.parallel.distributed import fetch, from_host, owning_processes, without_local_shards

DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "vocab": "tensor",
    # parameters and optimiser state over every learner chip: fsdp, and the chips a row's positions are split over
    "embed": ("fsdp", "sequence"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "linear_key_heads": "tensor",
    "linear_value_heads": "tensor",
    "linear_head_dim": None,
    "conv": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "experts_router": None,
    "norm": None,
    "layers": None,
    # activations (`constrain`): rows over every axis that splits rows, a row's positions over 'sequence' (size 1:
    # whole rows; models/qwen35_moe/row_split.py), the hidden dim whole per token
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": "sequence",
    "activation_embed": None,
    # a decode cache's sequence dim where its K/V split by position (models/qwen35_moe/split_kv_attention.py)
    "kv_sequence": "tensor",
}
BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")


def logical_partition_spec(logical_axes, shape, mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims are named `logical_axes`."""
    used, spec = set(), []
    for name, size in zip(logical_axes, shape):
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        total = 1
        for a in axes:
            total *= mesh.shape[a]
        if not axes or size % total:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def partitioned_mesh():
    """The mesh being traced under when XLA partitions the program over it (non-empty, more than one device, every
    axis auto), else None: on one device, inside `shard_map` (manual axes) or on a mesh with explicit axes there is
    nothing for a layout hint or a per-shard call to do."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or not mesh.are_all_axes_auto:
        return None
    return mesh


def constrain(x: jax.Array, logical_axes: tuple, rules=DEFAULT_RULES) -> jax.Array:
    """`x` pinned to the layout its dims' logical names give on the mesh being traced under
    (`parallel.with_mesh_context`, `jax.set_mesh`): a sharding constraint, not a copy. Outside a mesh, on one
    device, inside `shard_map` (manual axes) or on a mesh with explicit axes (whose types already carry the
    layout), `x` is returned as it is."""
    mesh = partitioned_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_partition_spec(logical_axes, x.shape, mesh, rules))


def _variable_axes(path, variable) -> tuple:
    """The variable's dims by logical name, as the model wrote them (metadata `logical_axes`; none: replicated)."""
    axes = tuple(variable.get_metadata().get("logical_axes", (None,) * variable.ndim))
    if len(axes) != variable.ndim:
        raise ValueError(f"the variable at {'/'.join(map(str, path))} has shape {variable.shape} but logical axes "
                         f"{axes}; the model must name every dim (a stacked axis too: params.LAYERS)")
    return axes


def variable_sharding(path, variable, mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Where the variable at `path` (a flat-state path) lives on `mesh`, by its logical axes."""
    return NamedSharding(mesh, logical_partition_spec(_variable_axes(path, variable), variable.shape, mesh, rules))


def param_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """A NamedSharding for every variable of `state` (same tree structure)."""
    return nnx.map_state(lambda path, variable: variable_sharding(path, variable, mesh, rules), state)


def shard_params(module: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place every parameter of `module` on `mesh` by its logical axes (in place); returns the module."""
    graphdef, state = nnx.split(module)
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        variable.set_value(jax.device_put(variable.get_value(), variable_sharding(path, variable, mesh, rules)))
    nnx.update(module, nnx.from_flat_state(flat))
    return module


def init_sharded(make: Callable[[], nnx.Module], mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """`make()` (a module constructor drawing from its own `nnx.Rngs`) created straight into its sharding on `mesh`:
    shapes by `nnx.eval_shape`, then one jitted init whose outputs are laid out by the logical axes, so no device
    ever holds the whole model. The values are those of `make()` run eagerly (the same random bits; the fused
    program may round the scaled draws differently, by an fp32 ulp)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    shardings = param_shardings(abstract_state, mesh, rules)
    state = jax.jit(lambda: nnx.state(make()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def copy_into(module_state: nnx.State, abstract_state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.State:
    """`abstract_state` (same paths) filled with a copy of `module_state`'s arrays, each put straight into its
    sharding on `mesh` (device to device; never gathered on one device, never aliasing the source). Across
    processes (a source or target this process cannot reach whole) a cross-process `device_put` is refused, so a
    leaf goes through the hosts instead: gathered whole on every host (`distributed.fetch`, one leaf at a time),
    each process placing its shards; every process calls it together."""
    source = dict(nnx.to_flat_state(module_state))
    flat = nnx.to_flat_state(abstract_state)
    for path, variable in flat:
        value, sharding = source[path].get_value(), variable_sharding(path, variable, mesh, rules)
        # decided from the layouts alone, the same on every process (whether *this* process reaches both is not)
        owners = owning_processes(value) | {d.process_index for d in sharding.device_set}
        if len(owners) > 1:
            variable.set_value(from_host(fetch(value), sharding))
        elif owners == {jax.process_index()}:
            variable.set_value(jax.device_put(value, sharding, may_alias=False))
        else:  # source and target are another process's alone: this one holds no shard of the copy
            variable.set_value(without_local_shards(value.shape, value.dtype, sharding))
    return nnx.from_flat_state(flat)
