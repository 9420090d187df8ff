"""The Gated DeltaNet's causal depthwise convolution over a row (kernel W = 4 in Qwen3.5), segment-aware."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_depthwise_conv(x_BxTxNxD: jax.Array, weight_WxNxD: jax.Array, *, segment_ids_BxT: jax.Array | None,
                          window_BxWm1xNxD: jax.Array | None, valid_BxT: jax.Array | None,
                          window_segment_ids_BxWm1: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """y[t] = sum_j w[j] * x[t - (W-1) + j], zero before the sequence (or the cached window) and, with segment ids,
    zero across a document start (the window's inputs count as segment `window_segment_ids`, default -1: none).
    Returns (y, new window of the last W-1 valid inputs) when a window is given."""
    B, T = x_BxTxNxD.shape[:2]
    W = weight_WxNxD.shape[0]
    if window_BxWm1xNxD is None:
        history_BxTpxNxD = jnp.pad(x_BxTxNxD, ((0, 0), (W - 1, 0), (0, 0), (0, 0)))
    else:
        history_BxTpxNxD = jnp.concatenate([window_BxWm1xNxD.astype(x_BxTxNxD.dtype), x_BxTxNxD], axis=1)
    if segment_ids_BxT is not None:
        seg_history = (jnp.pad(segment_ids_BxT, ((0, 0), (W - 1, 0)), constant_values=-1)
                       if window_segment_ids_BxWm1 is None
                       else jnp.concatenate([window_segment_ids_BxWm1.astype(segment_ids_BxT.dtype),
                                             segment_ids_BxT], axis=1))
    y_BxTxNxD = jnp.zeros(x_BxTxNxD.shape, jnp.float32)
    for j in range(W):
        tap_BxTxNxD = history_BxTpxNxD[:, j:j + T]
        if segment_ids_BxT is not None:
            same = seg_history[:, j:j + T] == segment_ids_BxT
            tap_BxTxNxD = jnp.where(same[..., None, None], tap_BxTxNxD, 0)
        y_BxTxNxD = y_BxTxNxD + tap_BxTxNxD.astype(jnp.float32) * weight_WxNxD[j].astype(jnp.float32)
    new_window = None
    if window_BxWm1xNxD is not None:
        lengths_B = jnp.full((B,), T) if valid_BxT is None else jnp.sum(valid_BxT, axis=1)
        # history index of token t is t + W - 1, so the last W-1 valid inputs start at index `length`
        index_BxWm1 = lengths_B[:, None] + jnp.arange(W - 1)[None, :]
        new_window = jnp.take_along_axis(history_BxTpxNxD, index_BxWm1[:, :, None, None], axis=1)
        new_window = new_window.astype(window_BxWm1xNxD.dtype)
    return y_BxTxNxD.astype(x_BxTxNxD.dtype), new_window
