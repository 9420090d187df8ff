"""The project's mesh: axes ('data', 'fsdp', 'sequence', 'expert', 'tensor'); a single device is a 1x1x1x1x1 mesh.

'sequence' splits one row's positions over chips (context parallelism, `models/qwen35_moe/row_split.py`); at
size 1 (the default) a mesh is what it was with four axes."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

MESH_AXES = ("data", "fsdp", "sequence", "expert", "tensor")


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with the sizes in `shape` (missing axes are 1; one axis may be -1)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_axis_sizes(shape, len(devices))
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def mesh_axis_sizes(shape: dict[str, int] | None, num_devices: int) -> dict[str, int]:
    """The size of every mesh axis for `shape` over `num_devices` devices (missing axes 1, one -1 takes the rest);
    ValueError when they do not multiply to `num_devices`."""
    sizes = {axis: 1 for axis in MESH_AXES}
    unknown = set(shape or {}) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {MESH_AXES}")
    sizes.update(shape or {})
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {free}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if any(size < 1 for size in sizes.values() if size != -1):
        raise ValueError(f"mesh axis sizes must be >= 1 (or one -1), got {sizes}")
    if free:
        if num_devices % known:
            raise ValueError(f"{num_devices} devices do not divide into the fixed axes of size {known}")
        sizes[free[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices but {num_devices} were given")
    return sizes


def mesh_of(tree) -> Mesh | None:
    """The mesh of the first `NamedSharding` (or array / ShapeDtypeStruct laid out by one) in `tree`, else None."""
    for leaf in jax.tree.leaves(tree):
        sharding = leaf if isinstance(leaf, NamedSharding) else getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def with_mesh_context(fn: Callable, mesh: Mesh | None) -> Callable:
    """`fn` tracing with `mesh` as the abstract mesh context: what kernels that XLA cannot partition read to wrap
    themselves in `shard_map` (splash attention, the expert-parallel MoE). Wrap a function before `jax.jit`; a
    mesh of one device (or None) leaves `fn` as it is."""
    if mesh is None or mesh.size == 1:
        return fn

    @functools.wraps(fn)
    def traced_on_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)
    return traced_on_mesh
