"""Chunked (WY / UT-transform) gated delta rule: the same recurrence as `reference.py`, C tokens at a time.

Within a chunk of C tokens (positions r, s), with Gamma = cumsum(g) inside the chunk:

    M[r, s] = exp(Gamma_r - Gamma_s) if r >= s and r, s are in the same document, else 0
    L       = strictly_lower((k * beta) k^T * M);   Tinv = (I + L)^-1          (recursive triangular inverse)
    U       = Tinv (v * beta);   W = Tinv (c * k * beta * exp(Gamma));   P = (q k^T) * M
    c_r     = 1 if position r is in the document of the token just before the chunk (chunk 0: of position 0), else 0

and across chunks, carrying the state S (K x V) in a `lax.scan`:

    V' = U - W S;   O = c * (q * exp(Gamma)) S + P V'
    S  = c_last * exp(Gamma_last) S + sum_{s in the last token's document} (k_s exp(Gamma_last - Gamma_s)) V'_s

Everything that does not depend on S (M, the triangular solve, U, W, P) is computed for all chunks at once before
the scan, so the sequential part is a few (C x K) @ (K x V) matmuls per chunk instead of C rank-one updates.
The c mask is what makes packed documents exact: the formulas are linear in the incoming state, a document start
zeroes the incoming state for every row after it, and M only couples rows of one document.

Numerics: Gamma_r - Gamma_s is summed directly over (s, r] rather than subtracted from the cumsum, which with strongly
negative g loses ~eps |Gamma| in the exponent (see `_pairwise_log_decay`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.gated_delta.reference import segment_starts

_PRECISION = jax.lax.Precision.HIGHEST  # fp32 semantics; TPU's default f32 matmul rounds operands to bf16.


def chunked_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, *,
                             initial_state_BxHxKxV=None, segment_ids_BxT=None, chunk_size=64):
    """The gated delta rule over a sequence in chunks of `chunk_size` (static); same contract as the recurrent form.

    Returns (o_BxTxHxV, final_state_BxHxKxV), float32. T is padded up to a multiple of `chunk_size` with steps of
    g = 0, beta = 0 and k = 0, which leave the state unchanged; padded segment ids repeat the last id.
    """
    batch, time, heads, key_dim = k_BxTxHxK.shape
    value_dim = v_BxTxHxV.shape[-1]
    chunk = int(chunk_size)
    padded_time = -(-time // chunk) * chunk
    num_chunks = padded_time // chunk
    if initial_state_BxHxKxV is None:
        initial_state_BxHxKxV = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    initial_state_BxHxKxV = jnp.asarray(initial_state_BxHxKxV, jnp.float32)

    def to_chunks(x_BxTxHx_):
        """[B, T, H, ...] float -> [N, B, H, C, ...] float32, zero-padded along T."""
        x = jnp.asarray(x_BxTxHx_, jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, padded_time - time)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((batch, num_chunks, chunk) + x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q_NxBxHxCxK, k_NxBxHxCxK, v_NxBxHxCxV = to_chunks(q_BxTxHxK), to_chunks(k_BxTxHxK), to_chunks(v_BxTxHxV)
    g_NxBxHxC, beta_NxBxHxC = to_chunks(g_BxTxH), to_chunks(beta_BxTxH)

    # Documents as a non-decreasing index (0, 0, 1, 1, 1, 2, ...), so "same document" is equality even when the
    # caller reuses an id for two separate runs.
    document_BxT = jnp.cumsum(segment_starts(segment_ids_BxT, (batch, time)), axis=1, dtype=jnp.int32)
    document_BxT = jnp.pad(document_BxT, ((0, 0), (0, padded_time - time)), mode="edge")
    document_NxBx1xC = jnp.moveaxis(document_BxT.reshape(batch, num_chunks, chunk), 1, 0)[:, :, None, :]
    previous_document_NxBx1 = jnp.concatenate(
        [document_NxBx1xC[:1, ..., 0], document_NxBx1xC[:-1, ..., -1]], axis=0)
    carries_in_NxBx1xC = document_NxBx1xC == previous_document_NxBx1[..., None]

    gamma_NxBxHxC = jnp.cumsum(g_NxBxHxC, axis=-1)
    log_decay_NxBxHxCxC = _pairwise_log_decay(g_NxBxHxC)
    causal_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    coupled_NxBx1xCxC = causal_CxC & (document_NxBx1xC[..., :, None] == document_NxBx1xC[..., None, :])
    decay_NxBxHxCxC = _masked_exp(log_decay_NxBxHxCxC, coupled_NxBx1xCxC)

    k_beta_NxBxHxCxK = k_NxBxHxCxK * beta_NxBxHxC[..., None]
    strictly_lower_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_), k=-1)
    lower_NxBxHxCxC = jnp.where(
        strictly_lower_CxC,
        jnp.einsum("...rk,...sk->...rs", k_beta_NxBxHxCxK, k_NxBxHxCxK, precision=_PRECISION) * decay_NxBxHxCxC,
        0.0)
    system_inverse_NxBxHxCxC = unit_lower_triangular_inverse(lower_NxBxHxCxC)
    carry_weight_NxBxHxC = jnp.where(carries_in_NxBx1xC, jnp.exp(gamma_NxBxHxC), 0.0)
    rhs_NxBxHxCxVK = jnp.concatenate(
        [v_NxBxHxCxV * beta_NxBxHxC[..., None], k_beta_NxBxHxCxK * carry_weight_NxBxHxC[..., None]], axis=-1)
    solved_NxBxHxCxVK = jnp.einsum("...rs,...sd->...rd", system_inverse_NxBxHxCxC, rhs_NxBxHxCxVK,
                                   precision=_PRECISION)
    u_NxBxHxCxV, w_NxBxHxCxK = solved_NxBxHxCxVK[..., :value_dim], solved_NxBxHxCxVK[..., value_dim:]

    attention_NxBxHxCxC = jnp.einsum(
        "...rk,...sk->...rs", q_NxBxHxCxK, k_NxBxHxCxK, precision=_PRECISION) * decay_NxBxHxCxC
    q_decayed_NxBxHxCxK = q_NxBxHxCxK * carry_weight_NxBxHxC[..., None]
    in_last_document_NxBx1xC = document_NxBx1xC == document_NxBx1xC[..., -1:]
    k_to_end_NxBxHxCxK = k_NxBxHxCxK * _masked_exp(
        log_decay_NxBxHxCxC[..., -1, :], in_last_document_NxBx1xC)[..., None]
    state_decay_NxBxH = carry_weight_NxBxHxC[..., -1]

    def chunk_step(state_BxHxKxV, chunk_inputs):
        u_BxHxCxV, w_BxHxCxK, q_BxHxCxK, attention_BxHxCxC, k_BxHxCxK, decay_BxH = chunk_inputs
        new_v_BxHxCxV = u_BxHxCxV - jnp.einsum("bhck,bhkv->bhcv", w_BxHxCxK, state_BxHxKxV, precision=_PRECISION)
        o_BxHxCxV = (jnp.einsum("bhck,bhkv->bhcv", q_BxHxCxK, state_BxHxKxV, precision=_PRECISION)
                     + jnp.einsum("bhrs,bhsv->bhrv", attention_BxHxCxC, new_v_BxHxCxV, precision=_PRECISION))
        state_BxHxKxV = (decay_BxH[..., None, None] * state_BxHxKxV
                         + jnp.einsum("bhck,bhcv->bhkv", k_BxHxCxK, new_v_BxHxCxV, precision=_PRECISION))
        return state_BxHxKxV, o_BxHxCxV

    final_state_BxHxKxV, o_NxBxHxCxV = jax.lax.scan(
        chunk_step, initial_state_BxHxKxV,
        (u_NxBxHxCxV, w_NxBxHxCxK, q_decayed_NxBxHxCxK, attention_NxBxHxCxC, k_to_end_NxBxHxCxK, state_decay_NxBxH))
    o_BxTxHxV = jnp.moveaxis(o_NxBxHxCxV, (0, 3), (1, 2)).reshape(batch, padded_time, heads, value_dim)
    return o_BxTxHxV[:, :time], final_state_BxHxKxV


def unit_lower_triangular_inverse(lower_xCxC):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by recursive 2x2 block inversion (only matmuls).

    [[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]], merged from 1x1 blocks up in log2(C) levels: a
    triangular solve written out, never a general inverse. Not `jax.scipy.linalg.solve_triangular`: on CPU it is a
    LAPACK custom call that deadlocked (jaxlib 0.10.2, 2-core host: the batched strsm kernel waits on XLA's intra-op
    thread pool from inside it) and ran ~100x slow with multithreaded OpenBLAS; matmuls avoid both and suit the MXU.
    """
    chunk = lower_xCxC.shape[-1]
    size = 1 << max(chunk - 1, 0).bit_length()  # pad to a power of two with identity rows (L = 0 there)
    lower = jnp.pad(lower_xCxC, [(0, 0)] * (lower_xCxC.ndim - 2) + [(0, size - chunk)] * 2)
    batch_shape = lower.shape[:-2]
    inverse_xNbxBxB = jnp.ones(batch_shape + (size, 1, 1), lower.dtype)  # inverses of the 1x1 diagonal blocks
    block = 1
    while block < size:
        pairs = size // (2 * block)
        # Diagonal (2b x 2b) blocks of L; X is the lower-left (b x b) quarter of each.
        blocks_xPx2Bx2B = jnp.einsum(
            "...iaib->...iab", lower.reshape(batch_shape + (pairs, 2 * block, pairs, 2 * block)))
        x_xPxBxB = blocks_xPx2Bx2B[..., block:, :block]
        a_inverse_xPxBxB, d_inverse_xPxBxB = inverse_xNbxBxB[..., 0::2, :, :], inverse_xNbxBxB[..., 1::2, :, :]
        off_diagonal_xPxBxB = -jnp.einsum("...ij,...jk,...kl->...il", d_inverse_xPxBxB, x_xPxBxB, a_inverse_xPxBxB,
                                          precision=_PRECISION)
        top_xPxBx2B = jnp.concatenate([a_inverse_xPxBxB, jnp.zeros_like(a_inverse_xPxBxB)], axis=-1)
        bottom_xPxBx2B = jnp.concatenate([off_diagonal_xPxBxB, d_inverse_xPxBxB], axis=-1)
        inverse_xNbxBxB = jnp.concatenate([top_xPxBx2B, bottom_xPxBx2B], axis=-2)
        block *= 2
    return inverse_xNbxBxB[..., 0, :chunk, :chunk]


def _pairwise_log_decay(g_NxBxHxC):
    """D[r, s] = sum_{s < j <= r} g_j = Gamma_r - Gamma_s for r >= s (0 for r < s), summed directly.

    Subtracting two cumsums instead leaves an absolute error ~eps |Gamma| in the exponent; with strongly negative g
    (|Gamma| in the hundreds over a chunk) that is a ~1e-5 relative error on decays near 1. Summing only the terms
    between s and r (all of one sign) keeps the error relative to D itself. The sum is a (C x C) @ (C x C) matmul.
    """
    chunk = g_NxBxHxC.shape[-1]
    up_to_r_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))        # [r, j]: j <= r
    after_s_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.float32), k=-1)  # [j, s]: j > s
    g_up_to_r_NxBxHxCxC = jnp.where(up_to_r_CxC, g_NxBxHxC[..., None, :], 0.0)
    return jnp.einsum("...rj,js->...rs", g_up_to_r_NxBxHxCxC, after_s_CxC, precision=_PRECISION)


def _masked_exp(exponent, mask):
    """exp(exponent) where mask, else 0; the masked exponent is replaced before exp, so no inf (or nan grad) arises."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0.0)), 0.0)
