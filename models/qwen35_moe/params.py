"""Parameter creation with logical axis names, and casting weights to the compute dtype.

Every parameter carries `logical_axes` metadata (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `experts`,
`vocab`, ...); parameters of scanned layer blocks get a leading `layers` axis. `mercury_jax.parallel` maps the
names to mesh axes, so sharding is configuration, not model code.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def normal_init(stddev: float) -> Initializer:
    return lambda key, shape, dtype: stddev * jax.random.normal(key, shape, dtype)


def constant_init(value: float) -> Initializer:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)

LAYERS = "layers"  # the logical name of the scanned blocks' stacked axis (parameters and decode caches)


def make_param(rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], logical_axes: Sequence[str | None],
               dtype) -> nnx.Param:
    """An `nnx.Param` of `shape`, initialised by `init`, tagged with one logical axis name per dimension."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), logical_axes=tuple(logical_axes))


def cast(param: nnx.Param | jax.Array, dtype) -> jax.Array:
    """The parameter's value in `dtype` (weights stay fp32 masters; compute happens in the activation dtype)."""
    value = param[...] if isinstance(param, nnx.Variable) else param
    return value.astype(dtype)
