"""Partial rotary position embedding (rotate-half pairing on the first `rotary_dim` dims of each head).

inv_freq[i] = theta^(-2i / rotary_dim); angle = position * inv_freq (fp32); cos/sin are cast to the activation
dtype; x_rot' = x_rot * cos + rotate_half(x_rot) * sin with rotate_half([a, b]) = [-b, a]; other dims pass through.
For text, Qwen3.5's interleaved multimodal RoPE (all three position streams equal) is exactly this 1-D RoPE.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions_BxT: jax.Array, *, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, rotary_dim] (the half-frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles_BxTxR2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    angles_BxTxR = jnp.concatenate([angles_BxTxR2, angles_BxTxR2], axis=-1)
    return jnp.cos(angles_BxTxR).astype(dtype), jnp.sin(angles_BxTxR).astype(dtype)


def apply_rope(x_BxTxNxD: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
    rotary_dim = cos_BxTxR.shape[-1]
    x_rot, x_pass = x_BxTxNxD[..., :rotary_dim], x_BxTxNxD[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos_BxTxR[:, :, None, :], sin_BxTxR[:, :, None, :]
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
