"""Loss aggregation as (numerator, denominator) pairs, so that a global mean is exact across micro-batches and devices.

A per-token loss x [B, T] with action mask m reduces to a pair (num, den) such that the loss is num / den. Both are
sums over rows, so summing them over micro-batches and devices (or passing the global `den` to every micro-batch)
gives exactly the mean over the whole batch, not a mean of per-micro-batch means:

- `token-mean`:              num = sum_{b,t} m x,                      den = sum_{b,t} m   (global action-token count)
- `seq-mean-token-mean`:     num = sum_b (sum_t m x / sum_t m),        den = #rows with an action token
- `seq-mean-token-sum-norm`: num = sum_b (sum_t m x) / norm_length,    den = #rows with an action token
  (Dr. GRPO: a constant `norm_length`, default T, instead of each row's own length)

Rows without action tokens add nothing to either side. The seq-* modes are exact across micro-batches as long as a
row is not split between them. With `segment_ids` [B, T] (packed rows, train/packing.py) a "sequence" of the seq-*
modes is a segment of a row (ids 1, 2, ...; 0 is padding) instead of the whole row.

Gradient accumulation: compute `den` for the whole step first (it needs only the masks), psum it over devices,
and pass it as `denominator` to every micro-batch loss; the sum of the micro-batch gradients is then the gradient
of the global mean.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

__all__ = ["LOSS_AGG_MODES", "aggregate", "denominator", "finalize", "aggregate_loss", "masked_mean"]


def aggregate(per_token, action_mask, mode="token-mean", *, norm_length=None, segment_ids=None):
    """Reduce a per-token quantity [B, T] to (num, den) float32 scalars under `mode` (module docstring)."""
    x_BxT = jnp.asarray(per_token, jnp.float32)
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    x_BxT = jnp.where(mask_BxT, x_BxT, 0.0)  # also blocks NaN/inf from padding positions
    if segment_ids is None or mode == "token-mean":
        row_sum_B = jnp.sum(x_BxT, axis=-1)
        row_count_B = jnp.sum(mask_BxT.astype(jnp.float32), axis=-1)
    else:  # one entry per (row, segment id): [B, T + 1], rows stay where they are
        def per_segment(values_BxT):
            return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=v.shape[0] + 1))(
                values_BxT, jnp.asarray(segment_ids, jnp.int32))
        row_sum_B, row_count_B = per_segment(x_BxT), per_segment(mask_BxT.astype(jnp.float32))
    if mode == "token-mean":
        return jnp.sum(row_sum_B), jnp.sum(row_count_B)
    rows = jnp.sum((row_count_B > 0).astype(jnp.float32))
    if mode == "seq-mean-token-mean":
        return jnp.sum(row_sum_B / jnp.maximum(row_count_B, 1.0)), rows
    if mode == "seq-mean-token-sum-norm":
        norm = float(x_BxT.shape[-1] if norm_length is None else norm_length)
        return jnp.sum(row_sum_B) / norm, rows
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def denominator(action_mask, mode="token-mean", segment_ids=None):
    """The `den` of `aggregate` from the mask alone: compute it over all micro-batches (and psum over devices)
    before the first forward pass, then pass it as `denominator=` to each micro-batch's loss."""
    return aggregate(jnp.zeros(jnp.shape(action_mask), jnp.float32), action_mask, mode, segment_ids=segment_ids)[1]


def finalize(num, den, denominator=None):
    """num / den, or num / `denominator` when a global one is given; 0 when the denominator is 0 (num is then 0)."""
    den = jnp.asarray(den if denominator is None else denominator, jnp.float32)
    return num / jnp.where(den > 0, den, 1.0)


def aggregate_loss(per_token, action_mask, mode="token-mean", *, norm_length=None, denominator=None,
                   segment_ids=None):
    """(loss, num, den): the scalar loss of this batch under `mode` and its (num, den) pair."""
    num, den = aggregate(per_token, action_mask, mode, norm_length=norm_length, segment_ids=segment_ids)
    return finalize(num, den, denominator), num, den


def masked_mean(x, mask):
    """Mean of x over mask (any shape), 0 if the mask is empty; for metrics."""
    mask = jnp.asarray(mask).astype(bool)
    return jnp.sum(jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)) / jnp.maximum(jnp.sum(mask), 1)
