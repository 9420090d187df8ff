"""Causal GQA self-attention through the Pallas TPU splash-attention kernel (jax.experimental.pallas.ops.tpu).

    out = softmax((q D^-0.5) k^T + causal mask + segment mask) v      (the kernel does not scale; q is pre-scaled)
The kernel takes one row ([heads, T, D]); rows are vmapped. Its static causal mask is built per padded length at
trace time; segment ids make the mask block-diagonal. The row is right-padded to a multiple of the block: padded
keys come after every real query, so the causal mask hides them. The kernel has its own flash backward.

TPU only (Mosaic); `interpret=True` runs it through the Pallas interpreter on any backend (slow; tests).
A Pallas call is not partitioned by XLA: under a multi-device mesh context (`jax.set_mesh`) the call runs in a
`shard_map` over the batch axes of the mesh ('data', 'fsdp', 'expert'), every row on its own chip, heads and
sequence whole. The batch must divide over those axes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

_LANES = 128  # the kernel's key-block granularity
BATCH_AXES = ("data", "fsdp", "expert")


def splash_self_attention(query_BxTxNxD: jax.Array, key_BxTxKxD: jax.Array, value_BxTxKxD: jax.Array,
                          segment_ids_BxT: jax.Array | None = None, *, block_size: int = 512,
                          interpret: bool = False) -> jax.Array:
    """softmax(q k^T / sqrt(D) + causal/segment mask) v with query head h on KV head h // (N / K): [B, T, N, D]."""
    B = query_BxTxNxD.shape[0]

    def rows(*args):
        return splash_rows(*args, block_size=block_size, interpret=interpret)

    args = (query_BxTxNxD, key_BxTxKxD, value_BxTxKxD) + (() if segment_ids_BxT is None else (segment_ids_BxT,))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and math.prod(mesh.shape.values()) > 1:
        batch_axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
        shards = math.prod(mesh.shape[a] for a in batch_axes)
        if B % shards:
            raise ValueError(f"splash attention: batch {B} does not divide over the mesh's batch axes "
                             f"{batch_axes} ({shards} shards); use a batch that is a multiple of {shards} or "
                             f"attention_impl='blockwise'")
        spec = P(batch_axes or None)
        rows = jax.shard_map(rows, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)
    return rows(*args)


def splash_rows(query_BxTxNxD: jax.Array, key_BxSxKxD: jax.Array, value_BxSxKxD: jax.Array,
                segment_ids_BxT: jax.Array | None = None, key_segment_ids_BxS: jax.Array | None = None, *,
                query_offset: int = 0, block_size: int = 512, interpret: bool = False) -> jax.Array:
    """The kernel on whole rows as given (no mesh logic): queries at positions `query_offset` + t (static) over keys
    at 0 .. S - 1 (S = T when 0), key k visible to query q when k <= q and (with segment ids) same document."""
    B, T, N, D = query_BxTxNxD.shape
    S = key_BxSxKxD.shape[1]
    if block_size % _LANES:
        raise ValueError(f"splash attention: block_size {block_size} must be a multiple of {_LANES}")
    block = min(block_size, _LANES * -(-max(T, S) // _LANES))
    T_pad, S_pad = block * -(-T // block), block * -(-S // block)
    pad_q, pad_k = ((0, 0), (0, T_pad - T), (0, 0), (0, 0)), ((0, 0), (0, S_pad - S), (0, 0), (0, 0))
    q_BxNxTxD = jnp.swapaxes(jnp.pad(query_BxTxNxD * jnp.asarray(D ** -0.5, query_BxTxNxD.dtype), pad_q), 1, 2)
    k_BxKxSxD = jnp.swapaxes(jnp.pad(key_BxSxKxD, pad_k), 1, 2)
    v_BxKxSxD = jnp.swapaxes(jnp.pad(value_BxSxKxD, pad_k), 1, 2)
    kernel = splash.make_splash_mha_single_device(
        splash.MultiHeadMask([splash.CausalMask((T_pad, S_pad), offset=query_offset)] * N),
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                      block_kv_dq=block),
        interpret=interpret)
    if segment_ids_BxT is None:
        out_BxNxTxD = jax.vmap(kernel)(q_BxNxTxD, k_BxKxSxD, v_BxKxSxD)
    else:
        if key_segment_ids_BxS is None:
            key_segment_ids_BxS = segment_ids_BxT
        # padded keys come after every real query: the causal mask hides them whatever their document
        q_seg = jnp.pad(segment_ids_BxT.astype(jnp.int32), ((0, 0), (0, T_pad - T)))
        k_seg = jnp.pad(key_segment_ids_BxS.astype(jnp.int32), ((0, 0), (0, S_pad - S)))
        out_BxNxTxD = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=splash.SegmentIds(q=qs, kv=ks)))(
            q_BxNxTxD, k_BxKxSxD, v_BxKxSxD, q_seg, k_seg)
    return jnp.swapaxes(out_BxNxTxD, 1, 2)[:, :T]
