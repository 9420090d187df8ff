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
any implementation (`impl`: the Pallas kernel on TPU, chunked elsewhere). A chip may hold several spans that are
not neighbours in the row (the model's zig-zag order, `span_table`): each is its own span above, run as one batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
                           beta_BxTxH: jax.Array, *, axis: str, span_table: np.ndarray | None = None,
                           initial_state_BxHxKxV: jax.Array | None = None,
                           segment_ids_BxT: jax.Array | None = None, impl: str = "auto",
                           chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_rule` on this chip's spans of the positions over mesh axis `axis` (inside `shard_map`; every
    other argument is this chip's shard). `span_table[c, j]` (static, [chips, m]) is the index in the row of chip
    c's j-th local span, the shard being those m spans of equal length back to back; None: one span a chip, in
    chip order. Returns (o [B, T, H, V] of this chip's positions, the state after the row's last position: the
    same on every chip), float32, equal to the unsplit rule's."""
    B, T, H, K = k_BxTxHxK.shape
    V = v_BxTxHxV.shape[-1]
    table = resolve_span_table(span_table, axis, T)
    m = table.shape[1]
    segments = None if segment_ids_BxT is None else to_span_batch(segment_ids_BxT, m)
    q, k, v, g, beta = (to_span_batch(a, m) for a in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH))
    maps, consts = span_state_map(k, g, beta, v, segment_ids_BxT=segments, impl=impl, chunk_size=chunk_size)
    all_maps, all_consts = (gather_in_row_order(a, axis, table) for a in (maps, consts))
    if segments is None:
        starts_sxB = jnp.zeros((table.size, B), jnp.bool_)
    else:  # a document starts at a span's first token when its id differs from the previous span's last
        firsts, lasts = (gather_in_row_order(a, axis, table) for a in (segments[:, 0], segments[:, -1]))
        starts_sxB = jnp.concatenate([jnp.zeros((1, B), jnp.bool_), firsts[1:] != lasts[:-1]], axis=0)
    state = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BxHxKxV is None
             else jnp.asarray(initial_state_BxHxKxV, jnp.float32))

    def enter(state_BxHxKxV, span):
        maps, consts, start_B = span
        state_BxHxKxV = jnp.where(start_B[:, None, None, None], 0.0, state_BxHxKxV)
        leaving = jnp.einsum("bhij,bhjv->bhiv", maps, state_BxHxKxV,
                             precision=jax.lax.Precision.HIGHEST) + consts
        return leaving, state_BxHxKxV

    final_BxHxKxV, entering_sxBxHxKxV = jax.lax.scan(enter, state, (all_maps, all_consts, starts_sxB))
    entering = entering_sxBxHxKxV[local_span_indices(axis, table)].reshape(m * B, H, K, V)
    o, _ = gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=entering, segment_ids_BxT=segments, impl=impl,
                            chunk_size=chunk_size)
    return from_span_batch(o, m), final_BxHxKxV


def resolve_span_table(span_table: np.ndarray | None, axis: str, length: int) -> np.ndarray:
    """The static [chips, m] span table (None: one span a chip, in chip order), checked against the axis size and
    this chip's `length` positions."""
    n = jax.lax.axis_size(axis)
    table = np.arange(n)[:, None] if span_table is None else np.asarray(span_table)
    if table.shape[0] != n or length % table.shape[1] or sorted(table.reshape(-1)) != list(range(table.size)):
        raise ValueError(f"span_table {table.tolist()} is not a split of {n} chips' {length} positions each into "
                         f"the row's spans")
    return table


def to_span_batch(x_BxTx___: jax.Array, m: int) -> jax.Array:
    """A chip's [B, m S, ...] (m local spans back to back) -> [m B, S, ...]: local span j's rows at j B .. j B + B."""
    B, T = x_BxTx___.shape[:2]
    rest = x_BxTx___.shape[2:]
    return jnp.moveaxis(x_BxTx___.reshape(B, m, T // m, *rest), 1, 0).reshape(m * B, T // m, *rest)


def from_span_batch(x_mBxSx___: jax.Array, m: int) -> jax.Array:
    """The inverse of `to_span_batch`."""
    mB, S = x_mBxSx___.shape[:2]
    rest = x_mBxSx___.shape[2:]
    return jnp.moveaxis(x_mBxSx___.reshape(m, mB // m, S, *rest), 0, 1).reshape(mB // m, m * S, *rest)


def gather_in_row_order(x_mBx___: jax.Array, axis: str, table: np.ndarray) -> jax.Array:
    """Every chip's per-span [m B, ...] (`to_span_batch` order) all-gathered over `axis` -> [spans, B, ...] with the
    row's span s at index s."""
    m = table.shape[1]
    gathered = jax.lax.all_gather(x_mBx___.reshape(m, -1, *x_mBx___.shape[1:]), axis)  # [n, m, B, ...]
    return gathered.reshape(table.size, *gathered.shape[2:])[np.argsort(table.reshape(-1))]


def local_span_indices(axis: str, table: np.ndarray) -> jax.Array:
    """This chip's m span indices in the row, [m] int32 (inside `shard_map`)."""
    return jnp.asarray(table, jnp.int32)[jax.lax.axis_index(axis)]


__all__ = ["from_span_batch", "gather_in_row_order", "local_span_indices", "resolve_span_table", "span_state_map",
           "split_gated_delta_rule", "to_span_batch"]
