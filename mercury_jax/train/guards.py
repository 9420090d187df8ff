"""Non-finite guards of the training loops: a NaN/inf loss, gradient or update is never applied, never
checkpointed, and either stops the run naming the step or (a configured budget of rare bad batches) is skipped.

Inside the jitted update (`state.make_update_step`):

    finite = isfinite(loss) & isfinite(|grad|_2)                 (|grad|_2 is the step's `grad_norm` metric)
    params', opt_state' = (new, new) if finite else (old, old)   (a select inside the step, no host round trip)

so a bad step leaves the parameters and the optimiser moments as they were. On the host, `NonFiniteGuard.check`
reads the same two scalars from the metrics the loops fetch anyway and applies `config.train.nonfinite`:
"raise" (default) raises `NonFiniteError` before anything of that step is saved, so the last checkpoint (keep-K
rotation included) stays the last finite state; "skip" counts the step (`nonfinite_skipped` in the metrics) and
goes on, raising once more than `train.max_skipped` steps were skipped.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mercury_jax.config.defaults import setting
from mercury_jax.config.validate import nonfinite_problem


class NonFiniteError(FloatingPointError):
    """A training step produced a non-finite loss, gradient or update."""


def finite_flag(loss, grad_norm) -> jax.Array:
    """Scalar bool (inside jit): the loss and the gradient norm are finite (a NaN/inf anywhere in the gradient
    makes its norm non-finite)."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def is_finite_update(metrics: dict) -> bool:
    """The same test on the host, from an update's fetched `loss` and `grad_norm` metrics."""
    return math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["grad_norm"]))


def keep_if_finite(finite, new, old):
    """`new` where `finite`, else `old`, leaf by leaf (inside jit; both trees of the same structure)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


class NonFiniteGuard:
    """The host-side policy over the steps' `finite` metric; `skipped` counts the skipped steps of the run."""
    def __init__(self, policy: str = "raise", max_skipped: int = 0, *, name: str = "train", skipped: int = 0):
        problem = nonfinite_problem(policy, max_skipped)
        if problem:
            raise ValueError(problem)
        self.policy, self.max_skipped, self.name, self.skipped = policy, max_skipped, name, skipped

    @classmethod
    def from_config(cls, train_cfg, *, name: str, history: list[dict] = ()) -> NonFiniteGuard:
        """From a config's `train` section (None or missing fields: raise). A resumed run continues the count of
        its earlier steps (the last `nonfinite_skipped` of `history`)."""
        skipped = next((r["nonfinite_skipped"] for r in reversed(list(history)) if "nonfinite_skipped" in r), 0)
        return cls(setting(train_cfg, "nonfinite"), setting(train_cfg, "max_skipped"), name=name,
                   skipped=int(skipped))

    def check(self, step: int, metrics: dict, *, what: str = "update") -> bool:
        """True when the update of these host `metrics` (with `loss`, `grad_norm`) was finite, hence applied. A
        non-finite one raises `NonFiniteError` (policy "raise", or the skip budget spent) or is counted and
        returns False."""
        if is_finite_update(metrics):
            return True
        bad = {k: float(v) for k, v in metrics.items() if _is_scalar(v) and not math.isfinite(float(v))}
        where = f"[{self.name}] step {step}: non-finite {what} ({_describe(bad)})"
        kept = "the update was not applied, and no state of this step was checkpointed"
        if self.policy == "raise":
            raise NonFiniteError(f"{where}; {kept} (the latest checkpoint is the last finite state). Lower the "
                                 f"learning rate or inspect this step's batch; to skip rare bad batches instead, "
                                 f"pass --config.train.nonfinite=skip --config.train.max_skipped=N")
        self.skipped += 1
        if self.skipped > self.max_skipped:
            raise NonFiniteError(f"{where}; {kept}. That is {self.skipped} skipped steps, more than "
                                 f"train.max_skipped = {self.max_skipped}: the run is diverging, not meeting a rare "
                                 f"bad batch; lower the learning rate or raise train.max_skipped")
        print(f"{where}: update skipped ({self.skipped} of at most {self.max_skipped})", flush=True)
        return False


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float)) or getattr(value, "size", 0) == 1


def _describe(bad: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "loss, gradient or update"
