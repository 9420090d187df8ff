"""The gated delta rule over a sequence split by position over chips (context parallelism), exact.

Per (row, head) the rule updates its state S in R^{K x V} affinely (`interface.gated_delta_rule`):

    S_t = A_t S_{t-1} + k_t (beta_t v_t)^T,   A_t = e^{g_t} (I - beta_t k_t k_t^T)   (S_t = 0 S_{t-1} + ... at a
                                                                                    document start)

so chip c's span of positions maps the state entering it to the state leaving it as  S -> M_c S + C_c,  with
M_c = A_last ... A_first (K x K) and C_c the span's final state from S = 0. Both come from one run of the rule over
the span with the values widened by K zero columns and the initial state [0 | I_K]: the state's first V columns
end at C_c, the last K at M_c (a document start inside the span zeroes both, as it should: nothing before it
reaches past it). The spans' maps are gathered over the axis (t (K^2 + K V) floats a row and head) and composed in
order from the row's initial state,

    S_in(0) = S_initial,   S_in(c + 1) = M_c S_in(c) + C_c,   S_in(c) = 0 where a document starts at c's first token

and each chip runs its span again from its true entering state S_in(c): outputs and final state equal the unsplit
rule's. Cost: the first pass is the rule at width V + K (twice the state-update FLOPs of a V = K head), the second
the rule itself; the collective is one all-gather of the maps. Runs per shard under `shard_map` over `axis`, with
any implementation (`impl`: the Pallas kernel on TPU, chunked elsewhere).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_kernels.gated_delta.interface import gated_delta_rule


def span_state_map(k_BxTxHxK: jax.Array, g_BxTxH: jax.Array, beta_BxTxH: jax.Array, v_BxTxHxV: jax.Array, *,
                   segment_ids_BxT: jax.Array | None = None, impl: str = "auto",
                   chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """(M [B, H, K, K], C [B, H, K, V]) with  final state = M S_initial + C  over this span (module docstring)."""
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    wide_v = jnp.concatenate([v_BxTxHxV, jnp.zeros((B, T, H, K), v_BxTxHxV.dtype)], axis=-1)
    start = jnp.concatenate([jnp.zeros((B, H, K, V), jnp.float32),
                             jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))], axis=-1)
    _, final_BxHxKxW = gated_delta_rule(jnp.zeros_like(k_BxTxHxK), k_BxTxHxK, wide_v, g_BxTxH, beta_BxTxH,
                                        initial_state_BxHxKxV=start, segment_ids_BxT=segment_ids_BxT, impl=impl,
                                        chunk_size=chunk_size)
    return final_BxHxKxW[..., V:], final_BxHxKxW[..., :V]


def split_gated_delta_rule(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxV: jax.Array, g_BxTxH: jax.Array,
                           beta_BxTxH: jax.Array, *, axis: str, initial_state_BxHxKxV: jax.Array | None = None,
                           segment_ids_BxT: jax.Array | None = None, impl: str = "auto",
                           chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_rule` on this chip's span of the positions, the spans in order over mesh axis `axis` (inside
    `shard_map`; every other argument is this chip's shard). Returns (o [B, T, H, V] of this span, the state after
    the row's last position: the same on every chip), float32, equal to the unsplit rule's."""
    B, _, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    maps_BxHxKxK, consts_BxHxKxV = span_state_map(k_BxTxHxK, g_BxTxH, beta_BxTxH, v_BxTxHxV,
                                                  segment_ids_BxT=segment_ids_BxT, impl=impl, chunk_size=chunk_size)
    all_maps = jax.lax.all_gather(maps_BxHxKxK, axis)  # [t, B, H, K, K]
    all_consts = jax.lax.all_gather(consts_BxHxKxV, axis)
    if segment_ids_BxT is None:
        starts_t = jnp.zeros((all_maps.shape[0], B), jnp.bool_)
    else:  # a document starts at a span's first token when its id differs from the previous span's last
        firsts = jax.lax.all_gather(segment_ids_BxT[:, 0], axis)
        lasts = jax.lax.all_gather(segment_ids_BxT[:, -1], axis)
        starts_t = jnp.concatenate([jnp.zeros((1, B), jnp.bool_), firsts[1:] != lasts[:-1]], axis=0)
    state = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BxHxKxV is None
             else jnp.asarray(initial_state_BxHxKxV, jnp.float32))

    def enter(state_BxHxKxV, span):
        maps, consts, start_B = span
        state_BxHxKxV = jnp.where(start_B[:, None, None, None], 0.0, state_BxHxKxV)
        leaving = jnp.einsum("bhij,bhjv->bhiv", maps, state_BxHxKxV,
                             precision=jax.lax.Precision.HIGHEST) + consts
        return leaving, state_BxHxKxV

    final_BxHxKxV, entering_txBxHxKxV = jax.lax.scan(enter, state, (all_maps, all_consts, starts_t))
    entering = entering_txBxHxKxV[jax.lax.axis_index(axis)]
    o_BxTxHxV, _ = gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
                                    initial_state_BxHxKxV=entering, segment_ids_BxT=segment_ids_BxT, impl=impl,
                                    chunk_size=chunk_size)
    return o_BxTxHxV, final_BxHxKxV


__all__ = ["span_state_map", "split_gated_delta_rule"]
