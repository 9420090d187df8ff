"""Pallas TPU kernel: a few queries' partial softmax attention over one layer of the carried K/V stack, read in place.

For each row b, KV head k and query row r (r = t G + g: token t, query head g of the head group on KV head k), over
the cached positions i < n_b (`limit_B`, this span's visible count):

    s_i = q_r . K[l, b, i, k] / sqrt(D),  m = max_i s_i,  l = sum_i exp(s_i - m),  o = sum_i exp(s_i - m) V[l, b, i, k]

(m = -inf, l = 0, o = 0 when nothing is visible), the triple a split-K/V decode combines across chips
(`models/qwen35_moe/split_kv_attention.py`). Grid (rows B, position blocks S / bs); the K and V blocks
[bs, K, D] of layer l (scalar-prefetched) come straight from the [L, B, S, K, D] stacks by the BlockSpecs' index
maps, so the layer's cache is never copied out of the stack (what an XLA dynamic slice before the dots does). The
running max, sum and output (online softmax over blocks) live in VMEM scratch; a block past the visible positions
repeats the last visible block's index (no new fetch) and skips its arithmetic. The declared cost counts every
block (a full cache: the decode's must-read estimate), so a cache read part-way costs less than declared.

VMEM (bs = 512, K = 2, D = 256, bf16): K and V blocks 512 KiB each, double-buffered 2 MiB; the queries and the
accumulator [K, R, D] f32, R <= 64 rows, 128 KiB. On a non-TPU backend the kernel runs in Pallas interpret mode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mercury_kernels.platform import target_platform

_F32 = jnp.float32
MAX_ROWS = 64  # query rows T G a call takes (a decode step's 1 token x 8 heads; a short speculative run)


def block_positions(span: int, preferred: int = 512) -> int:
    """The position block: the largest power of two <= `preferred` dividing `span`, else the whole span."""
    size = preferred
    while size >= 8:
        if span % size == 0:
            return size
        size //= 2
    return span


def pallas_cached_partial_softmax(q_BxTxKxGxD: jax.Array, keys_LxBxSxKxD: jax.Array, values_LxBxSxKxD: jax.Array,
                                  layer: jax.Array, limit_B: jax.Array, *, block_s: int = 512,
                                  interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(m [B, K, G, T], l [B, K, G, T], o [B, T, K, G, D]), f32, as in the module docstring, over positions
    i < limit_B[b] of layer `layer` of the stacks (a single layer's [B, S, K, D]: pass `x[None]` and layer 0)."""
    if interpret is None:
        interpret = target_platform() != "tpu"
    B, T, K, G, D = q_BxTxKxGxD.shape
    S = keys_LxBxSxKxD.shape[2]
    R = T * G
    if R > MAX_ROWS:
        raise ValueError(f"pallas_cached_partial_softmax: {T} tokens x {G} heads = {R} query rows, more than "
                         f"{MAX_ROWS}; use the XLA path for a prefill")
    bs = block_positions(S, block_s)
    q_BxKxRxD = jnp.moveaxis(q_BxTxKxGxD, 1, 2).reshape(B, K, R, D)
    layer_1 = jnp.reshape(layer, (1,)).astype(jnp.int32)
    limit_B = jnp.clip(limit_B.astype(jnp.int32), 0, S)

    def kv_block(b, j, layer_ref, limit_ref):
        last = jnp.maximum((limit_ref[b] + bs - 1) // bs - 1, 0)
        return layer_ref[0], b, jnp.minimum(j, last), 0, 0

    stats = pl.BlockSpec((None, K, R, 1), lambda b, j, layer_ref, limit_ref: (b, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # the layer, the visible count of every row
        grid=(B, S // bs),
        in_specs=[pl.BlockSpec((None, K, R, D), lambda b, j, layer_ref, limit_ref: (b, 0, 0, 0)),
                  pl.BlockSpec((None, None, bs, K, D), kv_block),
                  pl.BlockSpec((None, None, bs, K, D), kv_block)],
        out_specs=[stats, stats, pl.BlockSpec((None, K, R, D), lambda b, j, layer_ref, limit_ref: (b, 0, 0, 0))],
        scratch_shapes=[pltpu.VMEM((K, R, 1), _F32), pltpu.VMEM((K, R, 1), _F32), pltpu.VMEM((K, R, D), _F32)],
    )
    itemsize = jnp.dtype(keys_LxBxSxKxD.dtype).itemsize
    cost = pl.CostEstimate(flops=4 * B * K * R * S * D, transcendentals=B * K * R * S,
                           bytes_accessed=int(2 * B * S * K * D * itemsize
                                              + B * K * R * (D * (q_BxKxRxD.dtype.itemsize + 4) + 8)))
    m_BxKxRx1, l_BxKxRx1, o_BxKxRxD = pl.pallas_call(
        lambda *refs: _kernel(*refs, block=bs, scale=D ** -0.5),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, K, R, 1), _F32)] * 2 + [jax.ShapeDtypeStruct((B, K, R, D), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="cached_partial_softmax",
    )(layer_1, limit_B, q_BxKxRxD, keys_LxBxSxKxD, values_LxBxSxKxD)
    to_BxKxGxT = lambda x: jnp.swapaxes(x.reshape(B, K, T, G), 2, 3)  # noqa: E731
    o_BxTxKxGxD = jnp.moveaxis(o_BxKxRxD.reshape(B, K, T, G, D), 2, 1)
    return to_BxKxGxT(m_BxKxRx1), to_BxKxGxT(l_BxKxRx1), o_BxTxKxGxD


def _kernel(layer_ref, limit_ref, q_ref, keys_ref, values_ref, m_ref, l_ref, o_ref, m_sc, l_sc, acc_sc, *,
            block: int, scale: float):
    b, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    @pl.when(j * block < limit_ref[b])
    def _():
        keys, values = keys_ref[...], values_ref[...]
        for k in range(keys.shape[1]):
            scores_Rxbs = jax.lax.dot_general(q_ref[k], keys[:, k, :], (((1,), (1,)), ((), ())),
                                              preferred_element_type=_F32) * scale
            position = j * block + jax.lax.broadcasted_iota(jnp.int32, scores_Rxbs.shape, 1)
            scores_Rxbs = jnp.where(position < limit_ref[b], scores_Rxbs, -jnp.inf)
            m_old = m_sc[k]
            m_new = jnp.maximum(m_old, jnp.max(scores_Rxbs, axis=1, keepdims=True))  # finite: one is visible
            weights_Rxbs = jnp.exp(scores_Rxbs - m_new)
            alpha = jnp.where(jnp.isfinite(m_old), jnp.exp(m_old - m_new), 0.0)
            l_sc[k] = alpha * l_sc[k] + jnp.sum(weights_Rxbs, axis=1, keepdims=True)
            acc_sc[k] = alpha * acc_sc[k] + jnp.dot(weights_Rxbs.astype(values.dtype), values[:, k, :],
                                                    preferred_element_type=_F32)
            m_sc[k] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        m_ref[...] = m_sc[...]
        l_ref[...] = l_sc[...]
        o_ref[...] = acc_sc[...]


__all__ = ["MAX_ROWS", "block_positions", "pallas_cached_partial_softmax"]
