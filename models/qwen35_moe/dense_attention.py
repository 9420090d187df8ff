"""Attention with the whole [T, S] score matrix: every mask (causal, documents, a cache's filled positions) given
as a boolean [B, T, S]."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30


def grouped_attention(query_BxTxNxD: jax.Array, keys_BxSxKxD: jax.Array, values_BxSxKxD: jax.Array,
                      visible_BxTxS: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) where visible) v with query head h on KV head h // G; softmax in fp32."""
    B, T, N, D = query_BxTxNxD.shape
    K = keys_BxSxKxD.shape[2]
    G = N // K
    q_BxTxKxGxD = query_BxTxNxD.reshape(B, T, K, G, D)
    scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, keys_BxSxKxD,
                                  preferred_element_type=jnp.float32) * (D ** -0.5)
    scores_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], scores_BxKxGxTxS, _MASKED)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(query_BxTxNxD.dtype)
    out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs_BxKxGxTxS, values_BxSxKxD)
    return out_BxTxKxGxD.reshape(B, T, N, D)
