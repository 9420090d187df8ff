"""The project's mesh: axes ('data', 'fsdp', 'expert', 'tensor'); a single device is a 1x1x1x1 mesh."""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with the sizes in `shape` (missing axes are 1; one axis may be -1)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {axis: 1 for axis in MESH_AXES}
    unknown = set(shape or {}) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {MESH_AXES}")
    sizes.update(shape or {})
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {free}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into the fixed axes of size {known}")
        sizes[free[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices but {len(devices)} were given")
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)
