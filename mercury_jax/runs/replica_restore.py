"""A checkpoint's policy restored straight into rollout replicas' layouts, cast while it is read.

    meshes = replica_meshes(jax.devices(), {"tensor": 4})
    weights = restore_into_replicas(reader, "grpo", step, meshes, dtype="bfloat16")   # one tree per local replica
    engine = ReplicatedEngine(model, meshes=meshes, ..., weights=weights)           # or engine.install_weights(...)

The R replicas (equal meshes of S devices, each within one process) are viewed as one union mesh ("replica", then a
replica's axes) of R x S devices. Each parameter is restored by Orbax into the sharding its logical axes give on a
replica's axes, repeated over "replica": every device reads only its own shard of the checkpoint, the cast to the
rollout dtype happens as the shard is read (no fp32 copy on a device, none of the whole model on a host), and every
process calls it together (an ordinary Orbax restore of global arrays). Replica r's weights are then the union
array's shards on its devices, wrapped as arrays of its own mesh (no copy). The layout is `rollout/layout.py`'s:
the same `parallel.param_shardings` that `rollout_weights` and the collective publish use.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from mercury_jax.parallel.distributed import local_meshes
from mercury_jax.parallel.sharding import variable_sharding
from mercury_jax.runs.run_reader import RunReader

REPLICA = "replica"  # the union mesh's leading axis


def union_mesh(meshes: Sequence[Mesh]) -> Mesh:
    """The replicas' meshes stacked along a leading `REPLICA` axis (equal shapes and axis names)."""
    if not meshes or len({m.devices.shape for m in meshes}) != 1 or len({m.axis_names for m in meshes}) != 1:
        raise ValueError("restore_into_replicas needs one or more replica meshes of one shape and axis order")
    return Mesh(np.stack([m.devices for m in meshes]), (REPLICA, *meshes[0].axis_names))


def restore_into_replicas(reader: RunReader, stage: str, step: int, meshes: Sequence[Mesh], *, dtype=None,
                          local: Sequence[int] | None = None) -> list[nnx.State]:
    """The policy of checkpoint `step` in each replica's layout, floating parameters as `dtype` (None: the
    checkpoint's): one `nnx.State` per replica index of `local` (default: the replicas of this process)."""
    union = union_mesh(meshes)
    model, _, _ = reader.restore_policy(stage, step, dtype=dtype,
                                        shardings=lambda name, variable: variable_sharding(name, variable, union))
    _, state = nnx.split(model)
    if local is None:
        mine = local_meshes(meshes)  # the rule ReplicatedEngine drives its replicas by
        local = [r for r, m in enumerate(meshes) if m in mine]
    return [jax.tree.map(lambda a, r=r: replica_view(a, meshes[r]), state) for r in local]


def replica_view(array: jax.Array, mesh: Mesh) -> jax.Array:
    """The copy of `array` (a union-mesh array repeated over `REPLICA`) held by `mesh`'s devices, as an array of
    `mesh` with the same split (its shards, not a copy)."""
    spec = array.sharding.spec
    sharding = NamedSharding(mesh, spec)
    devices = set(mesh.devices.flat)
    shards = [s.data for s in array.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(array.shape, sharding, shards)


def restore_on_device(reader: RunReader, stage: str, step: int, device, *, dtype=None) -> nnx.Module:
    """The policy of checkpoint `step` as a model whose parameters sit whole on `device` (floating ones as
    `dtype`; None: the checkpoint's), read straight there."""
    model, _, _ = reader.restore_policy(stage, step, dtype=dtype,
                                        shardings=lambda name, variable: SingleDeviceSharding(device))
    return model
