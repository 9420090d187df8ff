"""Causal self-attention of rows split by position over the mesh's 'sequence' axis (`row_split.py`).

Each chip holds two spans of its rows' positions (zig-zag: spans c and 2n - 1 - c of 2n). Inside `shard_map`:
  1. K, V and segment ids are all-gathered over 'sequence' and put back in row order ([B, T, K, D]: Qwen3.5 has
     few KV heads, so this is a fraction of the queries' size; the backward sums the key/value cotangents back to
     their chips, a reduce-scatter);
  2. each local span (row span g, positions g S .. g S + S - 1) attends to the row's keys 0 .. g S + S - 1 with
     the causal mask shifted by g S and the segment mask, by the configured implementation:
       "dense"     the [S, T] scores masked;
       "blockwise" the online softmax over key blocks, a block skipped when it starts after the span's last query;
       "splash"    the Pallas kernel with a causal mask of offset g S; the offset must be static, so the chip's
                   span picks one of 2n kernels (`lax.switch`), each of which only visits its visible blocks.
A chip's work is (2n + 1) span pairs of S x S scores (the zig-zag balance), its traffic the row's K/V once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.parallel import logical_partition_spec, partitioned_mesh
from models.qwen35_moe.blockwise_attention import blockwise_attention
from models.qwen35_moe.dense_attention import grouped_attention
from models.qwen35_moe.row_split import SPANS_PER_CHIP, RowSplit
from models.qwen35_moe.splash_attention import splash_rows

ROWS = ("activation_batch", "activation_length", None, None)


def split_self_attention(query_BxTxNxD: jax.Array, key_BxTxKxD: jax.Array, value_BxTxKxD: jax.Array,
                         segment_ids_BxT: jax.Array | None, split: RowSplit, *, impl: str,
                         block_size: int) -> jax.Array:
    """`attention.self_attention` of rows in split order over the mesh being traced under: [B, T, N, D]."""
    mesh = partitioned_mesh()
    spec = logical_partition_spec(ROWS, query_BxTxNxD.shape, mesh)
    if spec[1] != split.axis:
        raise ValueError(f"split attention: the T dim is laid out {spec[1]!r}, not over '{split.axis}'")
    seg_spec = jax.sharding.PartitionSpec(spec[0], spec[1])

    def local(q_BxTxNxD, k_BxTxKxD, v_BxTxKxD, *segments):
        def gather(x):
            return split.to_natural(jax.lax.all_gather(x, split.axis, axis=1, tiled=True))
        keys_BxSxKxD, values_BxSxKxD = gather(k_BxTxKxD), gather(v_BxTxKxD)
        q_seg = segments[0] if segments else None
        k_seg = gather(q_seg) if segments else None
        S = split.span
        mine = split.local_spans()
        outs = []
        for j in range(SPANS_PER_CHIP):
            q_j = q_BxTxNxD[:, j * S:(j + 1) * S]
            seg_j = None if q_seg is None else q_seg[:, j * S:(j + 1) * S]
            outs.append(_span_attention(q_j, keys_BxSxKxD, values_BxSxKxD, seg_j, k_seg, mine[j], split, impl,
                                        block_size))
        return jnp.concatenate(outs, axis=1)

    args = (query_BxTxNxD, key_BxTxKxD, value_BxTxKxD) + (() if segment_ids_BxT is None else (segment_ids_BxT,))
    specs = (spec, spec, spec) + (() if segment_ids_BxT is None else (seg_spec,))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)(*args)


def _span_attention(q_BxSxNxD, keys_BxTxKxD, values_BxTxKxD, q_seg_BxS, k_seg_BxT, span_index, split: RowSplit,
                    impl: str, block_size: int):
    S = split.span
    if impl == "blockwise":
        return blockwise_attention(q_BxSxNxD, keys_BxTxKxD, values_BxTxKxD, q_seg_BxS, block_size=block_size,
                                   query_offset=span_index * S, key_segment_ids_BxS=k_seg_BxT)
    if impl == "splash":
        def kernel_at(g):
            # keys past the span's last query are never visible: hand the kernel only the first (g + 1) S
            keys, values = keys_BxTxKxD[:, :(g + 1) * S], values_BxTxKxD[:, :(g + 1) * S]
            k_seg = None if k_seg_BxT is None else k_seg_BxT[:, :(g + 1) * S]
            return lambda q, seg: splash_rows(q, keys, values, seg, k_seg, query_offset=g * S,
                                              block_size=block_size)
        branches = [kernel_at(g) for g in range(SPANS_PER_CHIP * split.chips)]
        if q_seg_BxS is None:
            return jax.lax.switch(span_index, [lambda q, b=b: b(q, None) for b in branches], q_BxSxNxD)
        return jax.lax.switch(span_index, branches, q_BxSxNxD, q_seg_BxS)
    if impl != "dense":
        raise ValueError(f"split attention: attention_impl {impl!r} is not dense, blockwise or splash")
    T = keys_BxTxKxD.shape[1]
    q_index_S = span_index * S + jnp.arange(S)
    visible_BxSxT = jnp.broadcast_to(q_index_S[:, None] >= jnp.arange(T)[None, :], (q_BxSxNxD.shape[0], S, T))
    if q_seg_BxS is not None:
        visible_BxSxT = visible_BxSxT & (q_seg_BxS[:, :, None] == k_seg_BxT[:, None, :])
    return grouped_attention(q_BxSxNxD, keys_BxTxKxD, values_BxTxKxD, visible_BxSxT)


__all__ = ["split_self_attention"]
