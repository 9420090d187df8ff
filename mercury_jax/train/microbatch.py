"""Exact gradient accumulation: one learner step over M micro-batches of whole rows, inside one jitted program.

A step's loss and each of its metrics is a ratio num / den whose numerator is a sum over rows
(rl/aggregation.py). The denominators are read from the WHOLE batch's masks before any forward pass
(`totals_fn(batch)`), and every micro-batch m contributes its share num_m / D, so

    loss   = sum_m num_m / D                           (= the whole-batch loss, not a mean of M means)
    grad   = sum_m d(num_m / D) / d params             (D does not depend on the parameters)
    metric = sum_m num_m^metric / D^metric

and the optimiser sees the whole-batch gradient once per step. A micro-batched loss function is
`loss_fn(model, micro_batch, totals) -> (loss share, {name: metric share})`: every value it returns adds up over
micro-batches. A metric that is a token mean over the action mask of a micro-batch becomes a share with
`token_share`.

Assignment: rows go to micro-batches in order, dealt round-robin: row b belongs to micro-batch b mod M. Rows sit
on the data shards in contiguous blocks of B / S, so when M divides B / S every shard gives B / (S M) of its own
rows to each micro-batch and the split moves no data (`validate.py` requires it). Rows are never cut, so the
seq-* aggregations stay exact. Balance by token count comes from packing (`packing.pack_batch`): trajectories
share rows first-fit decreasing, the filled rows take the first micro-batches, and a micro-batch whose mask is
empty is skipped (`lax.cond`; it would add exactly 0 to every sum), so a step pays for the micro-batches its
tokens fill.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax.rl.aggregation import denominator

__all__ = ["MaskTotals", "MicroBatchError", "accumulate", "map_rows", "merge_rows", "split_rows",
           "token_share"]


class MicroBatchError(ValueError):
    """A batch that cannot be split into the configured number of micro-batches."""


def split_rows(batch: dict, micro_batches: int) -> dict:
    """Every leaf [B, ...] -> [M, B / M, ...], micro-batch m holding rows m, m + M, m + 2M, ... (in order)."""
    rows = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(rows) != 1 or None in rows:
        raise MicroBatchError(f"a micro-batched step needs every batch entry to have the same leading row axis; got "
                              f"row counts {sorted(map(str, rows))}; pass [B, ...] arrays only")
    (b,) = rows
    if b % micro_batches:
        raise MicroBatchError(f"{b} rows do not split into {micro_batches} micro-batches; choose a micro_batches "
                              f"value that divides the rows per step (and the rows per data shard)")
    return jax.tree.map(lambda x: jnp.swapaxes(jnp.reshape(x, (b // micro_batches, micro_batches, *x.shape[1:])),
                                               0, 1), batch)


def merge_rows(stacked: jax.Array) -> jax.Array:
    """The inverse of `split_rows` for one array: [M, B / M, ...] -> [B, ...] with row b from micro-batch b mod M."""
    rows = jnp.swapaxes(stacked, 0, 1)
    return jnp.reshape(rows, (rows.shape[0] * rows.shape[1], *rows.shape[2:]))


def map_rows(fn: Callable, rows: dict, micro_batches: int, *, mask_key: str | None = None) -> jax.Array:
    """`fn(rows)` for a row-wise `fn` ({name: [B, ...]} -> [B, ...]), run on M micro-batches of rows one after
    another (`lax.map`: the forward's working set is that of B / M rows); M = 1 calls `fn` once. With `mask_key`,
    a micro-batch whose `rows[mask_key]` is all zero gives zeros without running `fn`."""
    if micro_batches == 1:
        return fn(rows)
    micro = split_rows(rows, micro_batches)
    if mask_key is not None:
        fn = _skip_empty(fn, mask_key, jax.eval_shape(fn, jax.tree.map(lambda x: x[0], micro)))
    return merge_rows(jax.lax.map(fn, micro))


def _skip_empty(fn: Callable, mask_key: str, shapes) -> Callable:
    """`fn(micro_batch)`, or zeros of `shapes` (fn's output shapes, traced once by the caller) when
    `micro_batch[mask_key]` is all zero."""
    def run_or_skip(micro_batch):
        return jax.lax.cond(jnp.any(micro_batch[mask_key] != 0), fn,
                            lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), micro_batch)
    return run_or_skip


def accumulate(share_fn: Callable, params, batch: dict, micro_batches: int, *, grad_shardings=None,
               mask_key: str | None = None):
    """((loss, metrics), grads) summed over the micro-batches of `batch` by one `lax.scan`, for
    `share_fn(params, micro_batch) -> (loss share, metric shares)`. `grad_shardings` (the parameters' shardings)
    pins the gradient accumulator to the parameters' layout. With `mask_key`, a micro-batch whose mask is all zero
    is skipped (its shares and gradient are exactly 0)."""
    micro = split_rows(batch, micro_batches)
    gradient = jax.value_and_grad(share_fn, has_aux=True)

    def value_and_grad(micro_batch):
        return gradient(params, micro_batch)

    def constrain(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    shapes = jax.eval_shape(value_and_grad, jax.tree.map(lambda x: x[0], micro))
    if mask_key is not None:
        value_and_grad = _skip_empty(value_and_grad, mask_key, shapes)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = (zeros[0], constrain(zeros[1]))

    def add_one(carry, micro_batch):
        (loss, metrics), grads = value_and_grad(micro_batch)
        total = jax.tree.map(jnp.add, carry, ((loss, metrics), grads))
        return (total[0], constrain(total[1])), None

    total, _ = jax.lax.scan(add_one, zeros, micro)
    return total


@dataclasses.dataclass(frozen=True)
class MaskTotals:
    """A `totals_fn`: the whole batch's denominators from its mask `batch[mask_key]` [B, T] (and its
    `segment_ids`, when packed): `den`, the loss's under `loss_agg` (aggregation.py), and `tokens`, the mask's
    token count that token-mean metrics divide by. Its `mask_key` also names what marks an empty micro-batch."""
    loss_agg: str = "token-mean"
    mask_key: str = "action_mask"

    def __call__(self, batch: dict) -> dict:
        mask = batch[self.mask_key]
        return {"den": denominator(mask, self.loss_agg, segment_ids=batch.get("segment_ids")),
                "tokens": jnp.sum(jnp.asarray(mask, jnp.float32))}



def token_share(mean, count, total):
    """A micro-batch's token mean over `count` action tokens as its share of the mean over the step's `total`
    tokens: mean * count / total (0 when the step has none). Exact up to one fp32 rounding of the mean."""
    return jnp.asarray(mean, jnp.float32) * count / jnp.maximum(total, 1.0)
