"""Cached attention with the K/V cache split by sequence over the tensor axis (flash-decoding across chips).

When a replica's tensor axis has more devices than the model has KV heads (35B-A3B: 2 KV heads, tensor=4), the
cache cannot split by head, and every chip would hold and read every slot's whole K/V. Instead the cache's
sequence dim is split over tensor: chip c of t holds positions [c S/t, (c+1) S/t) of every KV head. A query at
position q attends to the cached positions before the call's new tokens (p < start of the row's new tokens) and
to the new tokens up to its own. Each chip computes, for every query head, over the cached positions of its span

    m_c = max_j s_j,   l_c = sum_j exp(s_j - m_c),   o_c = sum_j exp(s_j - m_c) v_j,   s_j = q k_j^T / sqrt(D)

(nothing visible: m_c = -inf, l_c = o_c = 0); the spans combine as one softmax over the row,

    m = max_c m_c,   l = sum_c exp(m_c - m) l_c,   o = sum_c exp(m_c - m) o_c

(`pmax`, then `psum` of l and a reduce-scatter of o over the query heads when they divide the axis, else `psum`),
and the new tokens (every chip holds them) join that sum the same way, each chip scoring them for its own query
heads only (a long prefill's [T, T] scores split over the chips); out = o / l. Then each chip
writes the new keys/values whose positions fall in its span (a scatter of T rows; the others drop them). The cache
is read before it is written, straight from the buffer the decode loop carries: on TPU, for a decode's few query
rows, by a Pallas kernel whose index maps pick the layer's blocks out of the [L, B, S, K, D] stack
(mercury_kernels/cached_attention), so the layer's K/V is never copied out of it first. The whole query (every head)
goes to every chip: [B, T, N, D], small next to the cache. Each chip reads S/t of the cache per step instead of S, and
holds S/t of it.

Equal to the unsplit `attention.grouped_attention` path up to the order of the sum over positions (fp32: ~1e-7
relative). Rows are split over the mesh's row axes as the cache's slots are; the function runs under `shard_map`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mercury_jax.parallel import logical_partition_spec
from mercury_kernels.cached_attention import MAX_ROWS, pallas_cached_partial_softmax
from mercury_kernels.platform import target_platform

SPLIT_AXIS = "tensor"
ROWS = "activation_batch"
KV_SEQUENCE = "kv_sequence"  # the logical name of a cache's sequence dim when split (`parallel.DEFAULT_RULES`)


def kv_split_axis(num_kv_heads: int, cache_length: int, mesh: Mesh | None) -> str | None:
    """"tensor" when a K/V cache of `num_kv_heads` heads and `cache_length` positions is split by sequence on
    `mesh`: its tensor axis has more than one device, the KV heads do not divide it and the length does; else
    None (the cache splits by head, or not at all)."""
    if mesh is None or mesh.empty:
        return None
    t = dict(mesh.shape).get(SPLIT_AXIS, 1)
    if t <= 1 or num_kv_heads % t == 0 or cache_length % t:
        return None
    return SPLIT_AXIS


def kv_cache_axes(num_kv_heads: int, cache_length: int, mesh: Mesh | None) -> tuple:
    """The logical dim names of a [B, S, Nkv, D] K/V cache leaf on `mesh`: by sequence (`kv_split_axis`) or by
    head."""
    if kv_split_axis(num_kv_heads, cache_length, mesh):
        return (ROWS, KV_SEQUENCE, None, "head_dim")
    return (ROWS, None, "kv_heads", "head_dim")


def split_kv_cached_attention(query_BxTxNxD: jax.Array, key_BxTxKxD: jax.Array, value_BxTxKxD: jax.Array,
                              cache: dict, write_index_BxT: jax.Array, query_index_BxT: jax.Array,
                              mesh: Mesh) -> tuple[jax.Array, dict]:
    """(attention output [B, T, N, D] in the query dtype, the cache with the new K/V written) for queries at
    positions `query_index_BxT` attending causally to every cache position <= their own, the new keys/values
    written at `write_index_BxT` (positions >= S are dropped), the cache {"k", "v": [B, S, K, D]} split by
    sequence over `mesh`'s tensor axis; with a "layer" index, {"k", "v": [L, B, S, K, D]} of every scanned layer,
    this layer's read and written in place."""
    B, T, N, D = query_BxTxNxD.shape
    S, K = cache["k"].shape[-3], cache["k"].shape[-2]
    layer = cache.get("layer")
    axis = kv_split_axis(K, S, mesh)
    if axis is None:
        raise ValueError(f"split_kv_cached_attention: a cache of {K} KV heads x {S} positions does not split by "
                         f"sequence on mesh {dict(mesh.shape)}")
    t = mesh.shape[axis]
    spec = lambda names, shape: logical_partition_spec(names, shape, mesh)  # noqa: E731
    rows_spec = spec((ROWS,), (B,))
    cache_spec = spec(kv_cache_axes(K, S, mesh), cache["k"].shape[-4:])
    if layer is not None:
        cache_spec = PartitionSpec(None, *cache_spec)
    whole = lambda a: spec((ROWS,) + (None,) * (a.ndim - 1), a.shape)  # noqa: E731
    scatter_heads = N % t == 0
    out_spec = PartitionSpec(*rows_spec, None, axis if scatter_heads else None, None)

    layer_args = () if layer is None else (layer,)
    out, keys, values = jax.shard_map(
        lambda *args: _local_attention((axis, t, S), *args[:7], args[7] if layer_args else None), mesh=mesh,
        in_specs=(whole(query_BxTxNxD), whole(key_BxTxKxD), whole(value_BxTxKxD), cache_spec, cache_spec,
                  whole(write_index_BxT), whole(query_index_BxT)) + (PartitionSpec(),) * len(layer_args),
        out_specs=(out_spec, cache_spec, cache_spec), check_vma=False,
    )(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD, cache["k"], cache["v"], write_index_BxT, query_index_BxT,
      *layer_args)
    return out, {"k": keys, "v": values}


def _local_attention(split: tuple, query, key, value, keys, values, write_index, query_index, layer):
    """One chip's share of `split_kv_cached_attention` inside `shard_map`, `split` = (the mesh axis the cache
    is split over, its size, the whole cache length): its rows' queries over its span of the cache, combined
    across the axis with the new tokens (counted once), and the new keys / values written into its span."""
    axis, t, S = split
    T, N, D = query.shape[1:]
    K = key.shape[2]
    scatter_heads = N % t == 0
    dt = query.dtype
    b, s = keys.shape[-4], keys.shape[-3]
    G = N // K
    q_BxTxKxGxD = query.reshape(b, T, K, G, D)
    # the span's cached positions before the new tokens (read before this call's writes, straight from the
    # carried stack), then the new tokens themselves (every chip holds them: counted once, after the combine)
    start = jax.lax.axis_index(axis) * s
    old_max, old_norm, old_out = cached_partial_softmax(q_BxTxKxGxD, keys, values, layer,
                                                        query_index[:, 0] - start)
    heads = lambda x_BxKxGxT: jnp.moveaxis(x_BxKxGxT, -1, 1).reshape(b, T, -1)  # noqa: E731  -> [b, T, heads]
    total_max = jax.lax.pmax(old_max, axis)
    rescale = _rescale(old_max, total_max)
    old_norm_BxTxN = heads(jax.lax.psum(old_norm * rescale, axis))
    old_out_BxTxNxD = (old_out * jnp.moveaxis(rescale, -1, 1)[..., None]).reshape(b, T, N, D)
    total_max_BxTxN = heads(total_max)
    new_visible_BxTxT = ((jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])[None]
                         & (write_index < S)[:, None, :])
    if scatter_heads:  # this chip's n query heads from here on: the new tokens' scores for those heads only
        n = N // t
        first = jax.lax.axis_index(axis) * n
        own = lambda x: jax.lax.dynamic_slice_in_dim(x, first, n, axis=2)  # noqa: E731
        out_BxTxNxD = jax.lax.psum_scatter(old_out_BxTxNxD, axis, scatter_dimension=2, tiled=True)
        old_norm_BxTxN, total_max_BxTxN = own(old_norm_BxTxN), own(total_max_BxTxN)
        kv_head_n = (first + jnp.arange(n)) // G
        new_max, new_norm, new_out = _partial_softmax(
            own(query)[:, :, :, None], jnp.take(key, kv_head_n, axis=2).astype(dt),
            jnp.take(value, kv_head_n, axis=2).astype(dt), new_visible_BxTxT)
    else:
        out_BxTxNxD = jax.lax.psum(old_out_BxTxNxD, axis)
        new_max, new_norm, new_out = _partial_softmax(q_BxTxKxGxD, key.astype(dt), value.astype(dt),
                                                      new_visible_BxTxT)
    new_max_BxTxN, new_norm_BxTxN = heads(new_max), heads(new_norm)
    new_out_BxTxNxD = new_out.reshape(*new_max_BxTxN.shape, D)
    both_max = jnp.maximum(total_max_BxTxN, new_max_BxTxN)
    old_scale, new_scale = _rescale(total_max_BxTxN, both_max), _rescale(new_max_BxTxN, both_max)
    norm_BxTxN = old_norm_BxTxN * old_scale + new_norm_BxTxN * new_scale
    out_BxTxNxD = out_BxTxNxD * old_scale[..., None] + new_out_BxTxNxD * new_scale[..., None]
    out_BxTxNxD = out_BxTxNxD / jnp.maximum(norm_BxTxN, jnp.finfo(jnp.float32).tiny)[..., None]

    local_write = write_index - start
    local_write = jnp.where((local_write >= 0) & (local_write < s), local_write, s)  # not ours: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], local_write.shape)
    at = (rows, local_write) if layer is None else (layer, rows, local_write)
    keys = keys.at[at].set(key.astype(keys.dtype), mode="drop")
    values = values.at[at].set(value.astype(values.dtype), mode="drop")
    return out_BxTxNxD.astype(dt), keys, values


def cached_partial_softmax(q_BxTxKxGxD: jax.Array, keys: jax.Array, values: jax.Array, layer: jax.Array | None,
                           limit_B: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_partial_softmax` of the queries over the cached positions i < limit_B[b] of `keys` / `values` ([B, S, K, D],
    or with `layer` the [L, B, S, K, D] stacks and that layer): on TPU, for a decode's few query rows, the Pallas
    kernel reading the stacks in place (mercury_kernels/cached_attention); else XLA on the layer's slice (a copy)."""
    dt = q_BxTxKxGxD.dtype
    _, T, _, G, _ = q_BxTxKxGxD.shape
    if target_platform() == "tpu" and T * G <= MAX_ROWS and keys.dtype == dt:
        stacks = (keys, values, layer) if layer is not None else (keys[None], values[None], jnp.int32(0))
        return pallas_cached_partial_softmax(q_BxTxKxGxD, *stacks, limit_B)
    keys_BxSxKxD, values_BxSxKxD = (keys, values) if layer is None else (keys[layer], values[layer])
    S = keys_BxSxKxD.shape[1]
    visible_BxTxS = jnp.broadcast_to((jnp.arange(S)[None, :] < limit_B[:, None])[:, None, :], (len(limit_B), T, S))
    return _partial_softmax(q_BxTxKxGxD, keys_BxSxKxD.astype(dt), values_BxSxKxD.astype(dt), visible_BxTxS)


def _partial_softmax(q_BxTxKxGxD, keys_BxSxKxD, values_BxSxKxD, visible_BxTxS):
    """(m [B, K, G, T], l [B, K, G, T], o [B, T, K, G, D] unnormalised, f32) of softmax attention over the
    visible positions: m the max score (-inf when none is visible), l = sum exp(s - m), o = sum exp(s - m) v."""
    D = q_BxTxKxGxD.shape[-1]
    dt = q_BxTxKxGxD.dtype
    scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, keys_BxSxKxD,
                                  preferred_element_type=jnp.float32) * (D ** -0.5)
    visible = visible_BxTxS[:, None, None]
    max_BxKxGxT = jnp.max(jnp.where(visible, scores_BxKxGxTxS, -jnp.inf), axis=-1)
    shift = jnp.where(jnp.isfinite(max_BxKxGxT), max_BxKxGxT, 0.0)[..., None]
    weights_BxKxGxTxS = jnp.where(visible, jnp.exp(scores_BxKxGxTxS - shift), 0.0)
    out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", weights_BxKxGxTxS.astype(dt), values_BxSxKxD,
                               preferred_element_type=jnp.float32)
    return max_BxKxGxT, jnp.sum(weights_BxKxGxTxS, axis=-1), out_BxTxKxGxD


def _rescale(part_max, total_max):
    """exp(m_part - m_total), 0 where the part saw nothing (-inf)."""
    return jnp.where(jnp.isfinite(part_max), jnp.exp(part_max - jnp.where(jnp.isfinite(total_max), total_max, 0.0)),
                     0.0)
