"""A trainable model as functional state: graphdef + fp32 parameters + optimiser state, and a jitted update.

    params, opt_state = TrainState.create(model, tx).params, ...
    grads = jax.grad(loss)(params);  updates = tx.update(grads, opt_state, params);  params += updates
`trainable` selects which parameters the optimiser sees (the rest stay frozen, e.g. the critic's token mixing).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from mercury_jax.parallel import mesh_of, with_mesh_context
from mercury_jax.train.guards import finite_flag, keep_if_finite
from mercury_jax.train.microbatch import accumulate


@dataclasses.dataclass
class TrainState:
    graphdef: Any
    params: Any          # nnx.State of the trainable parameters (fp32 masters)
    frozen: Any          # nnx.State of everything else (may be empty)
    opt_state: Any
    tx: optax.GradientTransformation

    @classmethod
    def create(cls, model: nnx.Module, tx: optax.GradientTransformation,
               trainable: Callable | type = nnx.Param) -> TrainState:
        graphdef, params, frozen = nnx.split(model, trainable, ...)
        return cls(graphdef, params, frozen, tx.init(params), tx)

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def arrays(self) -> dict:
        """The checkpointable arrays."""
        return {"params": self.params, "frozen": self.frozen, "opt_state": self.opt_state}

    def replace_arrays(self, arrays: dict) -> TrainState:
        return dataclasses.replace(self, params=arrays["params"], frozen=arrays["frozen"],
                                   opt_state=arrays["opt_state"])


def make_update_step(graphdef, tx: optax.GradientTransformation, loss_fn: Callable, *, donate: bool = True,
                     state_shardings=None, micro_batches: int = 1, totals_fn: Callable | None = None):
    """jit(params, frozen, opt_state, batch) -> (params, opt_state, metrics) for `loss_fn(model, batch) -> (loss,
    metrics)`; metrics gain `loss` and `grad_norm`. A step whose loss or gradient norm is not finite returns params
    and opt_state unchanged (`guards.NonFiniteGuard` decides on the host whether the run goes on).
    `state_shardings` ((params, opt_state) shardings) pins the outputs to that layout, so the next step sees the
    same input layout and does not compile again.

    `micro_batches` M > 1 accumulates the gradient over M micro-batches of whole rows inside the step
    (`microbatch.py`): `totals_fn(batch)` gives the whole batch's denominators, and `loss_fn(model, micro_batch,
    totals)` returns shares that add up to the whole-batch loss and metrics. The optimiser runs once on the summed
    gradient. M = 1 is the plain whole-batch step, `totals_fn` unused. A `totals_fn` with a `mask_key`
    (`microbatch.MaskTotals`) also names the mask whose emptiness makes the step skip a micro-batch."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches is {micro_batches}; use 1 (the whole batch at once) or more")
    if micro_batches > 1 and totals_fn is None:
        raise ValueError(f"micro_batches={micro_batches} needs totals_fn (the whole batch's denominators) and a "
                         f"loss_fn(model, batch, totals) that returns shares (mercury_jax/train/microbatch.py)")
    grad_shardings = None if state_shardings is None else state_shardings[0]

    def loss_and_grad(params, frozen, batch):
        if micro_batches == 1:
            def wrapped(p):
                return loss_fn(nnx.merge(graphdef, p, frozen), batch)
            return jax.value_and_grad(wrapped, has_aux=True)(params)
        totals = totals_fn(batch)

        def share(p, micro_batch):
            return loss_fn(nnx.merge(graphdef, p, frozen), micro_batch, totals)
        return accumulate(share, params, batch, micro_batches, grad_shardings=grad_shardings,
                          mask_key=getattr(totals_fn, "mask_key", None))

    def step(params, frozen, opt_state, batch):
        (loss, metrics), grads = loss_and_grad(params, frozen, batch)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        # a non-finite loss or gradient changes nothing (guards.py); the host reads the same test from the metrics
        params, opt_state = keep_if_finite(finite_flag(loss, grad_norm),
                                           (optax.apply_updates(params, updates), new_opt_state), (params, opt_state))
        return params, opt_state, {**metrics, "loss": loss, "grad_norm": grad_norm}

    out_shardings = None if state_shardings is None else (*state_shardings, None)
    # kernels XLA cannot partition (splash attention, the EP MoE) shard_map themselves over the parameters' mesh
    return jax.jit(with_mesh_context(step, mesh_of(state_shardings)), donate_argnums=(0, 2) if donate else (),
                   out_shardings=out_shardings)
