"""Run a kernel XLA cannot partition (a Pallas / Mosaic call) once per shard of the mesh being traced under.

    per_shard(fn, args, in_axes, out_axes)  ==  fn(*args)
computed as `shard_map(fn)` whose in/out specs are the layouts the arrays' logical dim names give on the mesh
(`logical_partition_spec`, the same rules as `constrain`): each device runs `fn` on its own rows / heads. `fn` must
be independent along every sharded dim (rows, heads), which is what a per-row, per-head kernel is; a dim the mesh
does not divide stays whole. Outside a mesh, on one device, inside `shard_map` (manual axes) or on a mesh with
explicit axes, `fn(*args)` is called as it is.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from mercury_jax.parallel.sharding import DEFAULT_RULES, logical_partition_spec, partitioned_mesh


def per_shard(fn: Callable, args: Sequence, in_axes: Sequence[tuple | None], out_axes, rules=DEFAULT_RULES,
              out_shapes=None):
    """`fn(*args)` run per shard; `in_axes[i]` names the dims of `args[i]` (None: the argument is None and is passed
    as None); `out_axes` is a pytree like `fn`'s output with a tuple of dim names per array. `out_shapes` (that
    pytree's global `jax.ShapeDtypeStruct`s) is required when `fn` uses mesh-axis collectives (it cannot then be
    traced on the whole arrays to find them)."""
    mesh = partitioned_mesh()
    if mesh is None:
        return fn(*args)
    present = [i for i, a in enumerate(args) if a is not None]

    def call(*present_args):
        full = [None] * len(args)
        for i, a in zip(present, present_args):
            full[i] = a
        return fn(*full)

    in_specs = tuple(logical_partition_spec(in_axes[i], args[i].shape, mesh, rules) for i in present)
    if out_shapes is None:
        out_shapes = jax.eval_shape(call, *(args[i] for i in present))
    out_specs = jax.tree.map(lambda shape, names: logical_partition_spec(names, shape.shape, mesh, rules),
                             out_shapes, out_axes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        *(args[i] for i in present))
