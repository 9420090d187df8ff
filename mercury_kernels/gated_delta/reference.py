"""Recurrent gated delta rule: one token step, and a `lax.scan` of that step over time.

Per (batch, head) the state S in R^{K x V} evolves as

    S_t = e^{g_t} S_{t-1};   u_t = beta_t (v_t - S_t^T k_t);   S_t = S_t + k_t u_t^T;   o_t = S_t^T q_t.

This is the ground truth the chunked form is checked against, and the form used for decoding one token at a time.
It does T sequential rank-one updates, so it is slow for long prompts; use `chunked.py` there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# fp32 semantics on every backend: TPU's default f32 matmul precision rounds operands to bf16.
_PRECISION = jax.lax.Precision.HIGHEST


def gated_delta_step(q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, state_BxHxKxV):
    """One token of the gated delta rule; returns (o_BxHxV, new_state_BxHxKxV), both float32.

    q and k are L2-normalised, q is scaled by K^-0.5, g <= 0 is the log decay and beta in (0, 1).
    """
    q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, state_BxHxKxV = (
        jnp.asarray(x, jnp.float32) for x in (q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, state_BxHxKxV))
    state_BxHxKxV = jnp.exp(g_BxH)[..., None, None] * state_BxHxKxV
    predicted_v_BxHxV = jnp.einsum("bhk,bhkv->bhv", k_BxHxK, state_BxHxKxV, precision=_PRECISION)
    u_BxHxV = beta_BxH[..., None] * (v_BxHxV - predicted_v_BxHxV)
    state_BxHxKxV = state_BxHxKxV + k_BxHxK[..., :, None] * u_BxHxV[..., None, :]
    o_BxHxV = jnp.einsum("bhk,bhkv->bhv", q_BxHxK, state_BxHxKxV, precision=_PRECISION)
    return o_BxHxV, state_BxHxKxV


def recurrent_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, *,
                               initial_state_BxHxKxV=None, segment_ids_BxT=None):
    """The gated delta rule over a sequence as a `lax.scan` of `gated_delta_step`.

    Returns (o_BxTxHxV, final_state_BxHxKxV), float32. With `segment_ids_BxT` (packed documents), the state is zeroed
    before the update at every position whose id differs from the previous position's, so each document runs as if
    alone; `initial_state_BxHxKxV` (default zeros) is the state before position 0 and so only reaches the first one.
    """
    batch, _, heads, key_dim = k_BxTxHxK.shape
    value_dim = v_BxTxHxV.shape[-1]
    if initial_state_BxHxKxV is None:
        initial_state_BxHxKxV = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    initial_state_BxHxKxV = jnp.asarray(initial_state_BxHxKxV, jnp.float32)
    starts_BxT = segment_starts(segment_ids_BxT, k_BxTxHxK.shape[:2])

    def step(state_BxHxKxV, inputs):
        q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, start_B = inputs
        state_BxHxKxV = jnp.where(start_B[:, None, None, None], 0.0, state_BxHxKxV)
        o_BxHxV, state_BxHxKxV = gated_delta_step(q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, state_BxHxKxV)
        return state_BxHxKxV, o_BxHxV

    floats = [jnp.asarray(x, jnp.float32) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH)]
    time_major = [jnp.swapaxes(x, 0, 1) for x in (*floats, starts_BxT)]
    final_state_BxHxKxV, o_TxBxHxV = jax.lax.scan(step, initial_state_BxHxKxV, time_major)
    return jnp.swapaxes(o_TxBxHxV, 0, 1), final_state_BxHxKxV


def segment_starts(segment_ids_BxT, batch_time):
    """True where a new document starts after position 0 (the id changes from t-1 to t); all False without ids."""
    if segment_ids_BxT is None:
        return jnp.zeros(batch_time, jnp.bool_)
    segment_ids_BxT = jnp.asarray(segment_ids_BxT)
    changed_BxTm1 = segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]
    return jnp.pad(changed_BxTm1, ((0, 0), (1, 0)), constant_values=False)
