"""The two RMSNorms of Qwen3.5.

`RMSNorm` (layer norms, final norm, q/k norm) is zero-centred: y = x * rsqrt(mean(x^2) + eps) * (1 + w), all in
fp32, one cast back at the end; w starts at 0. `GatedRMSNorm` (GDN output) normalises in fp32, casts back,
multiplies by a plain w (starts at 1), then by silu(z) in fp32, and casts: y = cast(w * cast(norm(x)) * silu(z)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen35_moe.params import constant_init, make_param


def rms_normalize(x_f32: jax.Array, eps: float) -> jax.Array:
    return x_f32 * jax.lax.rsqrt(jnp.mean(jnp.square(x_f32), axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm over the last axis: x / rms(x) * (1 + w)."""

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs, logical_axis: str = "norm"):
        self.eps = eps
        self.weight = make_param(rngs, constant_init(0.0), (dim,), (logical_axis,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x.astype(jnp.float32), self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated RMSNorm of the GDN output: cast(w * cast(x / rms(x)) * silu(z)), w shared over heads."""

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = make_param(rngs, constant_init(1.0), (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        y = rms_normalize(x.astype(jnp.float32), self.eps).astype(x.dtype)
        y = self.weight[...] * y
        return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
