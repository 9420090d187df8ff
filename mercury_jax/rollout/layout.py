"""Where a rollout engine's arrays live on its replica's mesh, and how the rollout devices split into replicas.

A replica is one engine over a mesh of `replica_shape` (axes of `parallel.MESH_AXES`): its weights are sharded by
their logical names (heads / hidden units over tensor, experts over expert, the embedding's hidden dim over fsdp),
and its decode state (`Sampler.init_state`) is sharded with them:

    cache K/V            [B, S, Nkv, D]     slots over (data, fsdp, expert), kv heads over tensor; where the kv
                                            heads do not divide tensor, positions over tensor instead
    GDN conv windows     [B, W-1, H, D]     slots over (data, fsdp, expert), heads over tensor
    GDN state            [B, Hv, Dk, Dv]    slots over (data, fsdp, expert), value heads over tensor
    per-slot fields      [B, ...]           slots over (data, fsdp, expert)

(leaves under cache["blocks"] carry a leading, unsplit layers axis; the model names each cache leaf's dims:
`models/qwen35_moe/cache.py`). A dim the axes do not divide stays whole, as
for parameters (`parallel.logical_partition_spec`). The 35B-A3B model's 2 kv heads do not divide tensor=4, so its
K/V split by position (each chip holds a quarter of every slot's sequence) and the cached attention combines the
chips' partial softmaxes (models/qwen35_moe/split_kv_attention.py).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from mercury_jax.parallel import logical_partition_spec, make_mesh, param_shardings
from models.qwen35_moe.cache import SLOTS, cache_logical_axes


def state_logical_axes(path, leaf, mesh: Mesh | None = None) -> tuple:
    """The logical dim names of a leaf of the sampler state: cache leaves as the model lays its cache out
    (`models/qwen35_moe/cache.py:cache_logical_axes`), the other per-slot fields by slot."""
    keys = [getattr(p, "key", None) for p in path]
    if keys and keys[0] == "cache":
        return cache_logical_axes(path[1:], leaf, mesh)
    return (SLOTS,) + (None,) * (leaf.ndim - 1)


def state_shardings(state, mesh: Mesh):
    """A NamedSharding per leaf of the sampler state (arrays or ShapeDtypeStructs) on `mesh`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, logical_partition_spec(state_logical_axes(path, leaf, mesh),
                                                                      leaf.shape, mesh)), state)


def row_shardings(row, mesh: Mesh):
    """The layout of a 1-row cache taken out of the state's cache: heads (or K/V positions) split as in the cache,
    the row whole."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, logical_partition_spec(
            tuple(None if a == SLOTS else a for a in state_logical_axes((jax.tree_util.DictKey("cache"), *path),
                                                                        leaf, mesh)), leaf.shape, mesh)), row)


def rollout_dtype(leaf_dtype, dtype=None):
    """The dtype a weight of `leaf_dtype` has on the rollout side: `dtype` for floating weights (None: its own),
    integer leaves unchanged."""
    return jnp.dtype(dtype) if dtype is not None and jnp.issubdtype(leaf_dtype, jnp.floating) else leaf_dtype


def rollout_weights(params: nnx.State, mesh: Mesh | None, dtype=None) -> nnx.State:
    """`params` cast to `dtype` (floating leaves; None keeps theirs) where they are, then moved to their layout on
    `mesh` device to device, as a copy of their own (None: left where they are). The cast happens before the
    move, so an fp32 master never lands whole on a rollout device."""
    if dtype is not None:
        params = jax.jit(lambda p: jax.tree.map(lambda a: a.astype(rollout_dtype(a.dtype, dtype)), p))(params)
    if mesh is None:
        return params
    return jax.device_put(params, param_shardings(params, mesh), may_alias=False)


def replica_meshes(devices: Sequence, replica_shape: Mapping[str, int]) -> list[Mesh]:
    """The rollout devices split into R = len(devices) / replica size consecutive groups, one mesh of
    `replica_shape` (every axis size named; missing axes 1) each. ValueError when the size does not divide."""
    devices = list(devices)
    shape = dict(replica_shape)
    if any(size < 1 for size in shape.values()):
        raise ValueError(f"rollout replica shape {shape}: name every axis size of one replica (>= 1, no -1)")
    per_replica = math.prod(shape.values())
    if not devices or len(devices) % per_replica:
        raise ValueError(f"{len(devices)} rollout device(s) do not split into replicas of {per_replica} device(s) "
                         f"({shape}); make the replica size divide the rollout group")
    return [make_mesh(shape, devices=devices[i:i + per_replica]) for i in range(0, len(devices), per_replica)]
