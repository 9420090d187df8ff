"""Causal GQA attention in pure JAX without a [T, S] score matrix: an online softmax over key blocks (flash style).

The row is cut into blocks of `block_size` tokens. For query block i and key blocks j = 0 .. i (blocks j > i lie
wholly in the causal future and are skipped), with running max m, denominator l and accumulator acc per query:
    s = q k_j^T * D^-0.5  where visible (key index <= query index, same segment), else -1e30
    m' = max(m, rowmax(s));   r = exp(m - m');   p = exp(s - m')
    l' = r l + rowsum(p);     acc' = r acc + p v_j;         out = acc / l
Query blocks run in an outer `lax.scan`, key blocks in an inner one; both bodies are under `jax.checkpoint`, so
the backward keeps neither per-block scores nor every (query block x key block) accumulator: it recomputes one
query block at a time. Memory is O(T x block) for scores and O(T x N x D) for the rest; gradients are JAX autodiff.

With `query_offset` the queries are the row's positions offset .. offset + Tq - 1 and the keys its positions
0 .. Tk - 1 (one span of a row split over chips against the row's gathered keys, `split_attention.py`): "key index
<= query index" compares those, and a key block is skipped when its first key is after the block's last query
(the offset may be traced: the skip is a `lax.cond`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a row with no visible key yet gives exp(0) garbage that the next rescale wipes out


def blockwise_attention(query_BxTxNxD: jax.Array, key_BxSxKxD: jax.Array, value_BxSxKxD: jax.Array,
                        segment_ids_BxT: jax.Array | None = None, *, block_size: int = 512,
                        query_offset: jax.Array | int = 0, key_segment_ids_BxS: jax.Array | None = None
                        ) -> jax.Array:
    """softmax(q k^T / sqrt(D) + causal/segment mask) v, query head h on KV head h // (N / K); softmax in fp32.

    Self-attention over one row (queries and keys at the same T positions), or with `query_offset` queries at
    positions offset + t over the row's S >= offset + T keys (`key_segment_ids_BxS` their documents; default
    `segment_ids_BxT`, which then must cover the keys). Returns [B, T, N, D] in q's dtype.
    """
    B, T, N, D = query_BxTxNxD.shape
    S, K = key_BxSxKxD.shape[1:3]
    if N % K:
        raise ValueError(f"blockwise_attention: {N} query heads are not a multiple of {K} KV heads")
    if block_size < 1:
        raise ValueError(f"blockwise_attention: block_size {block_size} must be positive")
    G = N // K
    dt = query_BxTxNxD.dtype
    C = min(block_size, T, S)
    n_q, n_k = -(-T // C), -(-S // C)
    # padded keys sit after every real query, so the causal mask alone hides them
    if segment_ids_BxT is None:
        segment_ids_BxT = jnp.zeros((B, T), jnp.int32)
    if key_segment_ids_BxS is None:
        key_segment_ids_BxS = segment_ids_BxT if S == T else jnp.zeros((B, S), jnp.int32)
    q_segments_NqxBxC = _blocks(jnp.pad(segment_ids_BxT, ((0, 0), (0, n_q * C - T))), n_q)
    k_segments_NkxBxC = _blocks(jnp.pad(key_segment_ids_BxS, ((0, 0), (0, n_k * C - S))), n_k)
    # fp32 copies: the scans accumulate the q / k / v cotangents over blocks in the dtype of what they close over
    q_NqxBxCxKxGxD = _blocks(jnp.pad(query_BxTxNxD.astype(jnp.float32), ((0, 0), (0, n_q * C - T), (0, 0), (0, 0))),
                             n_q).reshape(n_q, B, C, K, G, D)
    k_NkxBxCxKxD = _blocks(jnp.pad(key_BxSxKxD.astype(jnp.float32), ((0, 0), (0, n_k * C - S), (0, 0), (0, 0))), n_k)
    v_NkxBxCxKxD = _blocks(jnp.pad(value_BxSxKxD.astype(jnp.float32), ((0, 0), (0, n_k * C - S), (0, 0), (0, 0))),
                           n_k)
    offsets_C = jnp.arange(C)

    def query_block(_, xs):
        q_BxCxKxGxD, q_segments_BxC, i = xs
        q_index_C = query_offset + i * C + offsets_C

        def key_block(carry, ys):
            k_BxCxKxD, v_BxCxKxD, k_segments_BxC, j = ys

            def update(carry):
                visible_BxCxC = (q_index_C[:, None] >= (j * C + offsets_C)[None, :])[None]
                visible_BxCxC = visible_BxCxC & (q_segments_BxC[:, :, None] == k_segments_BxC[:, None, :])
                return _fold_key_block(carry, q_BxCxKxGxD, k_BxCxKxD, v_BxCxKxD, visible_BxCxC, dt)

            return jax.lax.cond(j * C <= q_index_C[-1], update, lambda c: c, carry), None

        init = (jnp.full((B, K, G, C), _MASKED, jnp.float32), jnp.zeros((B, K, G, C), jnp.float32),
                jnp.zeros((B, K, G, C, D), jnp.float32))
        (_, l_BxKxGxC, acc_BxKxGxCxD), _ = jax.lax.scan(
            jax.checkpoint(key_block, prevent_cse=False), init,
            (k_NkxBxCxKxD, v_NkxBxCxKxD, k_segments_NkxBxC, jnp.arange(n_k)))
        out_BxKxGxCxD = acc_BxKxGxCxD / l_BxKxGxC[..., None]
        return None, jnp.transpose(out_BxKxGxCxD, (0, 3, 1, 2, 4)).reshape(B, C, N, D).astype(dt)

    _, out_NqxBxCxNxD = jax.lax.scan(jax.checkpoint(query_block, prevent_cse=False), None,
                                     (q_NqxBxCxKxGxD, q_segments_NqxBxC, jnp.arange(n_q)))
    return jnp.moveaxis(out_NqxBxCxNxD, 0, 1).reshape(B, n_q * C, N, D)[:, :T]


def _fold_key_block(carry, q_BxCxKxGxD: jax.Array, k_BxCxKxD: jax.Array, v_BxCxKxD: jax.Array,
                    visible_BxCxC: jax.Array, dt) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block folded into a query block's running softmax (m: the running max, l: its normaliser, acc: the
    unnormalised output): scores in fp32 from `dt` operands, hidden where not `visible`, the old sums rescaled to
    the new max."""
    m_BxKxGxC, l_BxKxGxC, acc_BxKxGxCxD = carry
    D = q_BxCxKxGxD.shape[-1]
    s_BxKxGxCxC = jnp.einsum("bqkgd,bckd->bkgqc", q_BxCxKxGxD.astype(dt), k_BxCxKxD.astype(dt),
                             preferred_element_type=jnp.float32) * (D ** -0.5)
    s_BxKxGxCxC = jnp.where(visible_BxCxC[:, None, None], s_BxKxGxCxC, _MASKED)
    # the result does not depend on m, so its gradient path is cut (exactly, not an approximation)
    m_new_BxKxGxC = jax.lax.stop_gradient(jnp.maximum(m_BxKxGxC, jnp.max(s_BxKxGxCxC, axis=-1)))
    rescale_BxKxGxC = jnp.exp(m_BxKxGxC - m_new_BxKxGxC)
    p_BxKxGxCxC = jnp.exp(s_BxKxGxCxC - m_new_BxKxGxC[..., None])
    l_BxKxGxC = rescale_BxKxGxC * l_BxKxGxC + jnp.sum(p_BxKxGxCxC, axis=-1)
    pv_BxKxGxCxD = jnp.einsum("bkgqc,bckd->bkgqd", p_BxKxGxCxC.astype(dt), v_BxCxKxD.astype(dt),
                              preferred_element_type=jnp.float32)
    acc_BxKxGxCxD = rescale_BxKxGxC[..., None] * acc_BxKxGxCxD + pv_BxKxGxCxD
    return m_new_BxKxGxC, l_BxKxGxC, acc_BxKxGxCxD


def _blocks(x_BxTx___: jax.Array, n_blocks: int) -> jax.Array:
    """[B, n*C, ...] -> [n, B, C, ...]: the block axis leads, for `lax.scan`."""
    B, TC = x_BxTx___.shape[:2]
    return jnp.moveaxis(x_BxTx___.reshape(B, n_blocks, TC // n_blocks, *x_BxTx___.shape[2:]), 1, 0)
