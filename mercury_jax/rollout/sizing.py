"""Does a rollout replica fit its devices? Checked from shapes and layouts, before anything is compiled or allocated.

    per chip = sum over weights of (bytes / shards)  +  sum over decode-state leaves of (bytes / shards)

with the weights in the rollout dtype and every leaf's shard count from its layout on the replica's mesh
(`layout.py`). The budget is the device's memory: `memory_stats()["bytes_limit"]` where the runtime reports it,
else the HBM of the device kind (`HBM_GIB`), else unchecked (a CPU device); `hbm_gib=` overrides it. What is left
over holds the decode program's temporaries (activations of one chunk, the logits of the slots).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mercury_jax.parallel import param_shardings
from mercury_jax.rollout.layout import rollout_dtype, state_shardings

GIB = 2 ** 30
HBM_GIB = {"TPU v5p": 95, "TPU v5": 95, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v6 lite": 32, "TPU v6e": 32,
           "TPU v4": 32}


class ReplicaDoesNotFit(ValueError):
    """The weights plus the decode state of a rollout replica exceed its devices' memory."""


def device_memory_gib(device) -> float | None:
    """The memory of `device` in GiB: the runtime's limit, else the HBM of its kind, else None (unknown)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (AOT topology devices and some backends have none)
        stats = None
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] / GIB
    return HBM_GIB.get(getattr(device, "device_kind", ""))


def _per_device_bytes(shapes, shardings) -> int:
    total = 0
    for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(shape.shape)
        total += math.prod(shard) * jnp.dtype(shape.dtype).itemsize
    return total


def replica_memory(param_shapes, state_shapes, mesh: Mesh, param_dtype=None) -> dict:
    """{"weights_gib", "state_gib", "total_gib"} per device of a replica on `mesh`: `param_shapes` an nnx.State of
    ShapeDtypeStructs (or arrays), `state_shapes` the sampler state's."""
    param_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, rollout_dtype(a.dtype, param_dtype)),
                                param_shapes)
    weights = _per_device_bytes(param_shapes, param_shardings(param_shapes, mesh)) / GIB
    state = _per_device_bytes(state_shapes, state_shardings(state_shapes, mesh)) / GIB
    return {"weights_gib": weights, "state_gib": state, "total_gib": weights + state}


def check_replica_fits(param_shapes, state_shapes, mesh: Mesh, *, num_slots: int, max_length: int,
                       param_dtype=None, hbm_gib: float | None = None) -> dict:
    """`replica_memory`, or ReplicaDoesNotFit naming the sizes and the knobs when it exceeds the device memory."""
    memory = replica_memory(param_shapes, state_shapes, mesh, param_dtype)
    budget = hbm_gib if hbm_gib is not None else device_memory_gib(mesh.devices.flat[0])
    memory["hbm_gib"] = budget
    if budget is not None and memory["total_gib"] > budget:
        shape = {a: s for a, s in mesh.shape.items() if s > 1}
        dtype = f" in {jnp.dtype(param_dtype).name}" if param_dtype else ""
        raise ReplicaDoesNotFit(
            f"a rollout replica on {mesh.size} device(s) {shape} needs {memory['total_gib']:.1f} GiB per device "
            f"(weights {memory['weights_gib']:.1f} GiB{dtype}, decode cache "
            f"{memory['state_gib']:.1f} GiB for {num_slots} slots x {max_length} tokens) but a device has "
            f"{budget:.1f} GiB; use more devices per replica (rollout.replica), fewer slots per replica "
            f"(rollout.num_slots), a shorter max length, or bf16 weights (rollout.param_dtype)")
    return memory
