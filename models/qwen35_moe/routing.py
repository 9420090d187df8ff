"""Top-k softmax routing of Qwen3.5-MoE, shared by every MoE implementation.

    p = softmax(x @ W_router) (fp32, over all E experts);  (w, e) = top_k(p);  w = w / sum_k(w)  (in x's dtype)
Ties are broken by `jax.lax.top_k` (lowest expert index first), identically on every path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x_NxH: jax.Array, router_HxE: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probs [N, E] fp32, weights [N, k] in x's dtype, expert ids [N, k] int32) for the rows of x."""
    probs_NxE = jax.nn.softmax((x_NxH @ router_HxE).astype(jnp.float32), axis=-1)
    top_w_NxK, top_e_NxK = jax.lax.top_k(probs_NxE, top_k)
    top_w_NxK = (top_w_NxK / jnp.sum(top_w_NxK, axis=-1, keepdims=True)).astype(x_NxH.dtype)
    return probs_NxE, top_w_NxK, top_e_NxK
