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
seq-* aggregations stay exact. Micro-batches are not balanced by token count (a later step).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from mercury_jax.rl.aggregation import denominator

__all__ = ["MicroBatchError", "accumulate", "map_rows", "mask_totals", "merge_rows", "split_rows", "token_share"]


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


def map_rows(fn: Callable, x: jax.Array, micro_batches: int) -> jax.Array:
    """`fn(x)` for a row-wise `fn` ([B, ...] -> [B, ...]), run on M micro-batches of rows one after another
    (`lax.map`: the forward's working set is that of B / M rows); M = 1 calls `fn` once."""
    if micro_batches == 1:
        return fn(x)
    return merge_rows(jax.lax.map(fn, split_rows({"x": x}, micro_batches)["x"]))


def accumulate(share_fn: Callable, params, batch: dict, micro_batches: int, *, grad_shardings=None):
    """((loss, metrics), grads) summed over the micro-batches of `batch` by one `lax.scan`, for
    `share_fn(params, micro_batch) -> (loss share, metric shares)`. `grad_shardings` (the parameters' shardings)
    pins the gradient accumulator to the parameters' layout."""
    micro = split_rows(batch, micro_batches)
    value_and_grad = jax.value_and_grad(share_fn, has_aux=True)

    def constrain(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    shapes = jax.eval_shape(value_and_grad, params, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = (zeros[0], constrain(zeros[1]))

    def add_one(carry, micro_batch):
        (loss, metrics), grads = value_and_grad(params, micro_batch)
        total = jax.tree.map(jnp.add, carry, ((loss, metrics), grads))
        return (total[0], constrain(total[1])), None

    total, _ = jax.lax.scan(add_one, zeros, micro)
    return total


def mask_totals(loss_agg: str = "token-mean", mask_key: str = "action_mask") -> Callable[[dict], dict]:
    """A `totals_fn`: the whole batch's denominators from its mask `batch[mask_key]` [B, T]: `den`, the loss's
    under `loss_agg` (aggregation.py), and `tokens`, the mask's token count that token-mean metrics divide by."""
    def totals(batch: dict) -> dict:
        mask = batch[mask_key]
        return {"den": denominator(mask, loss_agg), "tokens": jnp.sum(jnp.asarray(mask, jnp.float32))}
    return totals


def token_share(mean, count, total):
    """A micro-batch's token mean over `count` action tokens as its share of the mean over the step's `total`
    tokens: mean * count / total (0 when the step has none). Exact up to one fp32 rounding of the mean."""
    return jnp.asarray(mean, jnp.float32) * count / jnp.maximum(total, 1.0)
