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

from mercury_jax.train.guards import finite_flag, keep_if_finite


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
                     state_shardings=None):
    """jit(params, frozen, opt_state, batch) -> (params, opt_state, metrics) for `loss_fn(model, batch) -> (loss,
    metrics)`; metrics gain `loss` and `grad_norm`. A step whose loss or gradient norm is not finite returns params
    and opt_state unchanged (`guards.NonFiniteGuard` decides on the host whether the run goes on).
    `state_shardings` ((params, opt_state) shardings) pins the outputs to that layout, so the next step sees the
    same input layout and does not compile again."""
    def step(params, frozen, opt_state, batch):
        def wrapped(p):
            return loss_fn(nnx.merge(graphdef, p, frozen), batch)

        (loss, metrics), grads = jax.value_and_grad(wrapped, has_aux=True)(params)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        # a non-finite loss or gradient changes nothing (guards.py); the host reads the same test from the metrics
        params, opt_state = keep_if_finite(finite_flag(loss, grad_norm),
                                           (optax.apply_updates(params, updates), new_opt_state), (params, opt_state))
        return params, opt_state, {**metrics, "loss": loss, "grad_norm": grad_norm}

    out_shardings = None if state_shardings is None else (*state_shardings, None)
    return jax.jit(step, donate_argnums=(0, 2) if donate else (), out_shardings=out_shardings)
