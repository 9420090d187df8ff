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
    B, T, N, D = query_BxTxNxD.shape
    if block_size % _LANES:
        raise ValueError(f"splash attention: block_size {block_size} must be a multiple of {_LANES}")
    block = min(block_size, _LANES * -(-T // _LANES))
    T_pad = block * -(-T // block)
    pad = ((0, 0), (0, T_pad - T), (0, 0), (0, 0))
    q_BxNxTxD = jnp.swapaxes(jnp.pad(query_BxTxNxD * jnp.asarray(D ** -0.5, query_BxTxNxD.dtype), pad), 1, 2)
    k_BxKxTxD = jnp.swapaxes(jnp.pad(key_BxTxKxD, pad), 1, 2)
    v_BxKxTxD = jnp.swapaxes(jnp.pad(value_BxTxKxD, pad), 1, 2)
    segments_BxT = None if segment_ids_BxT is None else jnp.pad(segment_ids_BxT.astype(jnp.int32),
                                                                ((0, 0), (0, T_pad - T)))
    kernel = splash.make_splash_mha_single_device(
        splash.MultiHeadMask([splash.CausalMask((T_pad, T_pad))] * N),
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                      block_kv_dq=block),
        interpret=interpret)

    def rows(q_BxNxTxD, k_BxKxTxD, v_BxKxTxD, *segments):
        if not segments:
            return jax.vmap(kernel)(q_BxNxTxD, k_BxKxTxD, v_BxKxTxD)
        ids = segments[0]
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(
            q_BxNxTxD, k_BxKxTxD, v_BxKxTxD, ids)

    args = (q_BxNxTxD, k_BxKxTxD, v_BxKxTxD) + (() if segments_BxT is None else (segments_BxT,))
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
    out_BxNxTxD = rows(*args)
    return jnp.swapaxes(out_BxNxTxD, 1, 2)[:, :T]
