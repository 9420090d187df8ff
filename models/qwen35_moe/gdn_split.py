"""The Gated DeltaNet's two sequence-crossing steps on rows split by position over 'sequence' (`row_split.py`).

Under the split each chip holds spans c and 2n - 1 - c of its rows (zig-zag). Everything per token (projections,
beta, g, norms, the gated output) is left to XLA; these two steps see the whole row, so they run per shard
(`shard_map` through `parallel.per_shard`: rows over the row axes, heads over 'tensor', positions over 'sequence'):
  - the causal conv: a span's first W - 1 outputs read the previous span's last W - 1 inputs. Every chip's span
    tails ([B, W - 1, channels] a span, and their segment ids) are all-gathered over 'sequence' and each span takes
    its predecessor's as the conv window (zeros before the row's first span); a document start resets the window
    exactly as in one piece, since the window's tokens carry their segment ids;
  - the gated delta rule: `mercury_kernels/gated_delta/split.py` (each span's affine state map, composed in row
    order, each span rerun from its true entering state).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_jax.parallel import per_shard
from mercury_kernels.gated_delta.split import (
    from_span_batch,
    gather_in_row_order,
    local_span_indices,
    split_gated_delta_rule,
    to_span_batch,
)
from models.qwen35_moe.causal_conv import causal_depthwise_conv
from models.qwen35_moe.row_split import RowSplit

SEGMENTS = ("activation_batch", "activation_length")


def split_causal_conv(x_BxTxNxD: jax.Array, weight_WxNxD: jax.Array, segment_ids_BxT: jax.Array | None,
                      split: RowSplit, dims: tuple) -> jax.Array:
    """`gated_deltanet.causal_depthwise_conv` (no cache) of rows in split order; `dims` are x's logical dims."""
    W = weight_WxNxD.shape[0]
    if split.span < W - 1:
        raise ValueError(f"split conv: spans of {split.span} positions are shorter than the conv window {W - 1}")
    table = split.table

    def local(x, weight, segment_ids):
        m = table.shape[1]
        x_mBxSxNxD = to_span_batch(x, m)
        tails = gather_in_row_order(x_mBxSxNxD[:, -(W - 1):], split.axis, table)  # [spans, B, W-1, N, D]
        previous = local_span_indices(split.axis, table) - 1  # [m]; -1: the row's first span
        first = previous < 0
        window = tails[jnp.maximum(previous, 0)]  # [m, B, W-1, N, D]
        window = jnp.where(first[:, None, None, None, None], 0, window).reshape(-1, *window.shape[2:])
        window_segments, segments = None, None
        if segment_ids is not None:
            segments = to_span_batch(segment_ids, m)
            seg_tails = gather_in_row_order(segments[:, -(W - 1):], split.axis, table)
            window_segments = jnp.where(first[:, None, None], -1, seg_tails[jnp.maximum(previous, 0)])
            window_segments = window_segments.reshape(-1, W - 1)
        y, _ = causal_depthwise_conv(x_mBxSxNxD, weight, segment_ids_BxT=segments, window_BxWm1xNxD=window,
                                     valid_BxT=None, window_segment_ids_BxWm1=window_segments)
        return from_span_batch(y, m)

    weight_dims = ("conv",) + dims[2:]
    return per_shard(local, (x_BxTxNxD, weight_WxNxD, segment_ids_BxT), (dims, weight_dims, SEGMENTS), dims,
                     out_shapes=jax.ShapeDtypeStruct(x_BxTxNxD.shape, x_BxTxNxD.dtype))


def split_delta_rule(args: tuple, split: RowSplit, *, impl: str, chunk_size: int, value_dims: tuple,
                     gate_dims: tuple, state_dims: tuple):
    """`gated_delta_rule` of rows in split order: (o in split order, the final state of each row); `args` are the
    rule's (q, k, v, g, beta, initial_state, segment_ids), [B, T, H, K] / [B, T, H, V] / [B, T, H] / [B, H, K, V] /
    [B, T]."""
    def rule(q, k, v, g, beta, initial_state, segment_ids):
        return split_gated_delta_rule(q, k, v, g, beta, axis=split.axis, span_table=split.table,
                                      initial_state_BxHxKxV=initial_state, segment_ids_BxT=segment_ids, impl=impl,
                                      chunk_size=chunk_size)

    k_BxTxHxK, v_BxTxHxV = args[1], args[2]
    B, _, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    shapes = (jax.ShapeDtypeStruct(v_BxTxHxV.shape, jnp.float32), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32))
    return per_shard(rule, args, (value_dims, value_dims, value_dims, gate_dims, gate_dims, state_dims, SEGMENTS),
                     (value_dims, state_dims), out_shapes=shapes)


__all__ = ["split_causal_conv", "split_delta_rule"]
