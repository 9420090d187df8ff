"""One slot's cache row taken out of, and put back into, a decode cache whose slots are split over devices.

XLA partitions a dynamic slice along a split dimension by gathering the whole dimension first: for the released
cache (0.53 GiB a slot) that is every slot's cache on every device of the replica. Here each device works on its
own slots under `shard_map`:

    take:  row = psum_d( where(slot in shard d, cache_d[slot - d * n], 0) )     (n = slots per shard)
    put:   cache_d[slot - d * n] = row   on the shard holding `slot`; the others write their own row back

so a prefill moves one row (exactly: one shard contributes, the others add zeros). Heads stay split as in the cache.
Off a mesh, or when the slots are not split, these are the plain `take_row` / `put_row` below.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mercury_jax.rollout.layout import row_shardings, state_shardings
from models.qwen35_moe.cache import slot_axis


def take_row(cache: dict, slot: jax.Array) -> dict:
    """The 1-row cache of `slot`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=slot_axis(path)), cache)


def put_row(cache: dict, row: dict, slot: jax.Array) -> dict:
    """`cache` with the row of `slot` replaced by the 1-row cache `row`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=slot_axis(path)),
        cache, row)


def _layouts(cache: dict, mesh: Mesh):
    """(cache specs, row specs, per leaf in flattening order: (slot axis, mesh axes splitting the slots))."""
    cache_specs = jax.tree.map(lambda s: s.spec, state_shardings({"cache": cache}, mesh)["cache"])
    row_shapes = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(tuple(1 if i == slot_axis(path) else d for i, d in enumerate(a.shape)),
                                             a.dtype), cache)
    row_specs = jax.tree.map(lambda s: s.spec, row_shardings(row_shapes, mesh))
    leaves = []
    for (path, _), spec in zip(jax.tree_util.tree_flatten_with_path(cache)[0],
                               jax.tree_util.tree_leaves(cache_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        axis = slot_axis(path)
        entry = spec[axis] if axis < len(spec) else None
        leaves.append((axis, () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)))
    return cache_specs, row_specs, leaves


def _shard_slot(slot, axes, n):
    """(index of `slot` in this device's shard of n slots, whether the shard holds it)."""
    index = slot - jax.lax.axis_index(axes) * n
    return jnp.clip(index, 0, n - 1), (index >= 0) & (index < n)


def take_row_on_mesh(cache: dict, slot: jax.Array, mesh: Mesh) -> dict:
    """The 1-row cache of `slot`, laid out like the cache minus its slot split (`layout.row_shardings`)."""
    cache_specs, row_specs, leaves = _layouts(cache, mesh)
    if not any(axes for _, axes in leaves):
        return take_row(cache, slot)

    def local(cache_local, slot):
        flat, treedef = jax.tree.flatten(cache_local)
        rows = []
        for a, (axis, axes) in zip(flat, leaves):
            if not axes:
                rows.append(jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=axis))
                continue
            index, inside = _shard_slot(slot, axes, a.shape[axis])
            row = jax.lax.dynamic_slice_in_dim(a, index, 1, axis=axis)
            rows.append(jax.lax.psum(jnp.where(inside, row, jnp.zeros_like(row)), axes))
        return jax.tree.unflatten(treedef, rows)

    return jax.shard_map(local, mesh=mesh, in_specs=(cache_specs, PartitionSpec()), out_specs=row_specs,
                         check_vma=False)(cache, slot)


def put_row_on_mesh(cache: dict, row: dict, slot: jax.Array, mesh: Mesh) -> dict:
    """`cache` with the row of `slot` replaced by the 1-row cache `row`; each device writes its own slots only."""
    cache_specs, row_specs, leaves = _layouts(cache, mesh)
    if not any(axes for _, axes in leaves):
        return put_row(cache, row, slot)

    def local(cache_local, row, slot):
        flat, treedef = jax.tree.flatten(cache_local)
        out = []
        for a, r, (axis, axes) in zip(flat, jax.tree.leaves(row), leaves):
            r = r.astype(a.dtype)
            if not axes:
                out.append(jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=axis))
                continue
            index, inside = _shard_slot(slot, axes, a.shape[axis])
            kept = jax.lax.dynamic_slice_in_dim(a, index, 1, axis=axis)
            out.append(jax.lax.dynamic_update_slice_in_dim(a, jnp.where(inside, r, kept), index, axis=axis))
        return jax.tree.unflatten(treedef, out)

    return jax.shard_map(local, mesh=mesh, in_specs=(cache_specs, row_specs, PartitionSpec()), out_specs=cache_specs,
                         check_vma=False)(cache, row, slot)
