"""Token embedding lookup x = E[ids] that moves only a device's own tokens when the table is sharded.

Off a mesh, on one device, inside `shard_map` or on a mesh with explicit axes it is `jnp.take`. Under a mesh, XLA
partitions a gather from a table whose hidden dim is split over 'fsdp' by all-gathering every device's gathered
rows: a collective of [global tokens, H / fsdp] that grows with the batch and the chip count. Here, per shard
(`shard_map`), with the table shard [V / t, H / f] ('vocab' over 'tensor', 'embed' over 'fsdp'):
  1. the ids of the f devices that hold the other column slices (the 'fsdp' group) are all-gathered: [f n] int32;
  2. each device looks them up in its shard: rows of the vocab it holds, zero elsewhere, summed over 'tensor' when
     the vocab is split;
  3. an all_to_all over 'fsdp' hands every device its own tokens' slices from the f peers: [n, H].
Per device that is f n ids and n H values, flat in the chip count at fixed tokens per chip. The backward is the
transpose (all_to_all back, scatter-add into the local table shard); the table is never all-gathered.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.parallel import BATCH_LENGTH_EMBED, logical_partition_spec, partitioned_mesh

TABLE = ("vocab", "embed")
IDS = ("activation_batch", "activation_length")


def embed_tokens(table_VxH: jax.Array, ids_BxT: jax.Array, dtype) -> jax.Array:
    """table[ids] in `dtype`: [B, T, H]."""
    mesh = partitioned_mesh()
    if mesh is None:
        return jnp.take(table_VxH, ids_BxT, axis=0).astype(dtype)
    table_spec = logical_partition_spec(TABLE, table_VxH.shape, mesh)
    ids_spec = logical_partition_spec(IDS, ids_BxT.shape, mesh)
    vocab_axis, hidden_axis = table_spec[0], table_spec[1]
    row_axes = ids_spec[0] if isinstance(ids_spec[0], tuple) else (ids_spec[0],)
    if not isinstance(vocab_axis, str | None) or not isinstance(hidden_axis, str | None) or (
            hidden_axis is not None and hidden_axis not in row_axes):
        # a layout this lookup does not cover (rows not split over the table's hidden axis): XLA's gather
        return jnp.take(table_VxH, ids_BxT, axis=0).astype(dtype)
    out_spec = logical_partition_spec(BATCH_LENGTH_EMBED, (*ids_BxT.shape, table_VxH.shape[1]), mesh)

    def local(table_vxh, ids_bxt):
        b, t = ids_bxt.shape
        ids_m = ids_bxt.reshape(-1)
        if hidden_axis is not None:
            ids_m = jax.lax.all_gather(ids_m, hidden_axis, tiled=True)  # [f n]: the fsdp group's tokens
        if vocab_axis is None:
            rows_mxh = jnp.take(table_vxh, ids_m, axis=0).astype(dtype)
        else:
            local_ids_m = ids_m - jax.lax.axis_index(vocab_axis) * table_vxh.shape[0]
            held_m = (local_ids_m >= 0) & (local_ids_m < table_vxh.shape[0])
            rows_mxh = jnp.take(table_vxh, jnp.clip(local_ids_m, 0, table_vxh.shape[0] - 1), axis=0)
            rows_mxh = jax.lax.psum(jnp.where(held_m[:, None], rows_mxh, 0).astype(dtype), vocab_axis)
        if hidden_axis is not None:
            group = jax.lax.axis_size(hidden_axis)
            rows_gxnxh = rows_mxh.reshape(group, b * t, rows_mxh.shape[-1])
            rows_mxh = jax.lax.all_to_all(rows_gxnxh, hidden_axis, 0, 2, tiled=True).reshape(b * t, -1)
        return rows_mxh.reshape(b, t, -1)

    return jax.shard_map(local, mesh=mesh, in_specs=(table_spec, ids_spec), out_specs=out_spec)(table_VxH, ids_BxT)
