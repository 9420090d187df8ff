"""Chunked (WY / UT-transform) gated delta rule: the same recurrence as `reference.py`, C tokens at a time.

Within a chunk of C tokens (positions r, s), with Gamma = cumsum(g) inside the chunk:

    M[r, s] = exp(Gamma_r - Gamma_s) if r >= s and r, s are in the same document, else 0
    L       = strictly_lower((k * beta) k^T * M);   Tinv = (I + L)^-1          (recursive triangular inverse)
    U       = Tinv (v * beta);   W = Tinv (c * k * beta * exp(Gamma));   P = (q k^T) * M
    c_r     = 1 if position r is in the document of the token just before the chunk (chunk 0: of position 0), else 0

and across chunks, carrying the state S (K x V) in a `lax.scan`:

    V' = U - W S;   O = c * (q * exp(Gamma)) S + P V'
    S  = c_last * exp(Gamma_last) S + sum_{s in the last token's document} (k_s exp(Gamma_last - Gamma_s)) V'_s

Everything that does not depend on S (M, the triangular solve, U, W, P) is computed for a block of chunks at once
before a scan over that block's chunks, so the sequential part is a few (C x K) @ (K x V) matmuls per chunk instead
of C rank-one updates. Blocks hold a fixed number of elements (`chunks_per_block`), so memory and time per token do
not grow with T; an outer scan carries the state from block to block, checkpointed so the backward pass keeps only
each block's inputs and incoming state.
The c mask is what makes packed documents exact: the formulas are linear in the incoming state, a document start
zeroes the incoming state for every row after it, and M only couples rows of one document.

Numerics: Gamma_r - Gamma_s is summed directly over (s, r] rather than subtracted from the cumsum, which with strongly
negative g loses ~eps |Gamma| in the exponent (see `_pairwise_log_decay`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mercury_kernels.gated_delta.reference import segment_starts

_PRECISION = jax.lax.Precision.HIGHEST  # fp32 semantics; TPU's default f32 matmul rounds operands to bf16.


def chunked_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, *,
                             initial_state_BxHxKxV=None, segment_ids_BxT=None, chunk_size=64, block_chunks=None):
    """The gated delta rule over a sequence in chunks of `chunk_size` (static); same contract as the recurrent form.

    Returns (o_BxTxHxV, final_state_BxHxKxV), float32. T is padded up to a whole number of blocks of chunks with
    steps of g = 0, beta = 0 and k = 0, which leave the state unchanged; padded segment ids repeat the last id.
    Cost and memory are linear in T: see `chunks_per_block` for why the chunks are grouped into blocks;
    `block_chunks` (static) overrides how many chunks a block holds at most (tests use it to force many blocks).
    """
    batch, time, heads, key_dim = k_BxTxHxK.shape
    value_dim = v_BxTxHxV.shape[-1]
    chunk = int(chunk_size)
    if block_chunks is None:
        block_chunks = chunks_per_block(batch, heads, chunk)
    if not isinstance(block_chunks, int) or block_chunks < 1:
        raise ValueError(f"chunked_gated_delta_rule: block_chunks must be a positive int (static) or None, got "
                         f"{block_chunks!r}")
    num_blocks, block_chunks = block_layout(-(-time // chunk), block_chunks)
    num_chunks = num_blocks * block_chunks
    padded_time = num_chunks * chunk
    if initial_state_BxHxKxV is None:
        initial_state_BxHxKxV = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    initial_state_BxHxKxV = jnp.asarray(initial_state_BxHxKxV, jnp.float32)

    def to_blocks(x_BxTxHx_):
        """[B, T, H, ...] float -> [Nb, Sb, B, H, C, ...] float32 (blocks of chunks), zero-padded along T."""
        x = jnp.asarray(x_BxTxHx_, jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, padded_time - time)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((batch, num_blocks, block_chunks, chunk) + x.shape[2:])
        return jnp.moveaxis(x, (1, 2, 3), (0, 1, 4))

    # Documents as a non-decreasing index (0, 0, 1, 1, 1, 2, ...), so "same document" is equality even when the
    # caller reuses an id for two separate runs. These per-position [B, T] masks are cheap; every C x C quantity is
    # formed inside the block loop.
    document_BxT = jnp.cumsum(segment_starts(segment_ids_BxT, (batch, time)), axis=1, dtype=jnp.int32)
    document_BxT = jnp.pad(document_BxT, ((0, 0), (0, padded_time - time)), mode="edge")
    document_NxBx1xC = jnp.moveaxis(document_BxT.reshape(batch, num_chunks, chunk), 1, 0)[:, :, None, :]
    previous_document_NxBx1 = jnp.concatenate(
        [document_NxBx1xC[:1, ..., 0], document_NxBx1xC[:-1, ..., -1]], axis=0)
    carries_in_NxBx1xC = document_NxBx1xC == previous_document_NxBx1[..., None]
    per_block = lambda x: x.reshape((num_blocks, block_chunks) + x.shape[1:])  # noqa: E731

    block_inputs = (to_blocks(q_BxTxHxK), to_blocks(k_BxTxHxK), to_blocks(v_BxTxHxV), to_blocks(g_BxTxH),
                    to_blocks(beta_BxTxH), per_block(document_NxBx1xC), per_block(carries_in_NxBx1xC))
    # Checkpointed: the backward pass recomputes a block's C x C quantities from its inputs and its incoming state
    # instead of keeping them for all T (which would be ~C floats per token and head: 64x the state-free inputs).
    final_state_BxHxKxV, o_NbxSbxBxHxCxV = jax.lax.scan(
        jax.checkpoint(_block_step, prevent_cse=False), initial_state_BxHxKxV, block_inputs)
    o_BxTxHxV = jnp.moveaxis(o_NbxSbxBxHxCxV, (0, 1, 4), (1, 2, 3)).reshape(batch, padded_time, heads, value_dim)
    return o_BxTxHxV[:, :time], final_state_BxHxKxV


# Elements of one C x C array summed over the chunks of a block and over batch x heads. A block's live set is about
# a dozen such arrays, so 2**18 elements (1 MiB each) keeps it near 12 MiB whatever T is.
_BLOCK_ELEMENTS = 1 << 18


def chunks_per_block(batch, heads, chunk):
    """How many chunks one block step processes: ~_BLOCK_ELEMENTS / (B H C^2), at least 1.

    Why blocks: computing the C x C quantities (decays, (I + L)^-1, U, W, q k^T) for all T / C chunks before the
    sequential scan, as this module once did, needs O(T C) floats of temporaries per head (74 MiB at T = 8,192,
    H = 4, C = 64). That is still linear work, but once the temporaries outgrow the cache and the allocator's reuse
    threshold every call pays DRAM traffic and fresh page faults for them, so the time per token rose with T (7.7 ms
    at T = 1,024 but 244 ms at 8,192 in BENCHMARKS.md). A block of a fixed number of chunks keeps the working set,
    and with it the time per token, independent of T.
    """
    return max(1, _BLOCK_ELEMENTS // (batch * heads * chunk * chunk))


def block_layout(num_chunks, max_block_chunks):
    """(num_blocks, chunks_per_block) covering `num_chunks` with fewest blocks and < num_blocks chunks of padding."""
    num_blocks = -(-num_chunks // max_block_chunks)
    return num_blocks, -(-num_chunks // num_blocks)


def _block_step(state_BxHxKxV, block_inputs):
    """One block of Sb chunks: the S-independent C x C algebra for all its chunks at once, then a scan over them."""
    (q_SxBxHxCxK, k_SxBxHxCxK, v_SxBxHxCxV, g_SxBxHxC, beta_SxBxHxC, document_SxBx1xC,
     carries_in_SxBx1xC) = block_inputs
    value_dim = v_SxBxHxCxV.shape[-1]
    chunk = g_SxBxHxC.shape[-1]
    gamma_SxBxHxC = jnp.cumsum(g_SxBxHxC, axis=-1)
    log_decay_SxBxHxCxC = _pairwise_log_decay(g_SxBxHxC)
    causal_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    coupled_SxBx1xCxC = causal_CxC & (document_SxBx1xC[..., :, None] == document_SxBx1xC[..., None, :])
    decay_SxBxHxCxC = _masked_exp(log_decay_SxBxHxCxC, coupled_SxBx1xCxC)

    k_beta_SxBxHxCxK = k_SxBxHxCxK * beta_SxBxHxC[..., None]
    strictly_lower_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_), k=-1)
    lower_SxBxHxCxC = jnp.where(
        strictly_lower_CxC,
        jnp.einsum("...rk,...sk->...rs", k_beta_SxBxHxCxK, k_SxBxHxCxK, precision=_PRECISION) * decay_SxBxHxCxC,
        0.0)
    system_inverse_SxBxHxCxC = unit_lower_triangular_inverse(lower_SxBxHxCxC)
    carry_weight_SxBxHxC = jnp.where(carries_in_SxBx1xC, jnp.exp(gamma_SxBxHxC), 0.0)
    rhs_SxBxHxCxVK = jnp.concatenate(
        [v_SxBxHxCxV * beta_SxBxHxC[..., None], k_beta_SxBxHxCxK * carry_weight_SxBxHxC[..., None]], axis=-1)
    solved_SxBxHxCxVK = jnp.einsum("...rs,...sd->...rd", system_inverse_SxBxHxCxC, rhs_SxBxHxCxVK,
                                   precision=_PRECISION)
    u_SxBxHxCxV, w_SxBxHxCxK = solved_SxBxHxCxVK[..., :value_dim], solved_SxBxHxCxVK[..., value_dim:]

    attention_SxBxHxCxC = jnp.einsum(
        "...rk,...sk->...rs", q_SxBxHxCxK, k_SxBxHxCxK, precision=_PRECISION) * decay_SxBxHxCxC
    q_decayed_SxBxHxCxK = q_SxBxHxCxK * carry_weight_SxBxHxC[..., None]
    in_last_document_SxBx1xC = document_SxBx1xC == document_SxBx1xC[..., -1:]
    k_to_end_SxBxHxCxK = k_SxBxHxCxK * _masked_exp(
        log_decay_SxBxHxCxC[..., -1, :], in_last_document_SxBx1xC)[..., None]
    state_decay_SxBxH = carry_weight_SxBxHxC[..., -1]

    def chunk_step(state_BxHxKxV, chunk_inputs):
        u_BxHxCxV, w_BxHxCxK, q_BxHxCxK, attention_BxHxCxC, k_BxHxCxK, decay_BxH = chunk_inputs
        new_v_BxHxCxV = u_BxHxCxV - jnp.einsum("bhck,bhkv->bhcv", w_BxHxCxK, state_BxHxKxV, precision=_PRECISION)
        o_BxHxCxV = (jnp.einsum("bhck,bhkv->bhcv", q_BxHxCxK, state_BxHxKxV, precision=_PRECISION)
                     + jnp.einsum("bhrs,bhsv->bhrv", attention_BxHxCxC, new_v_BxHxCxV, precision=_PRECISION))
        state_BxHxKxV = (decay_BxH[..., None, None] * state_BxHxKxV
                         + jnp.einsum("bhck,bhcv->bhkv", k_BxHxCxK, new_v_BxHxCxV, precision=_PRECISION))
        return state_BxHxKxV, o_BxHxCxV

    return jax.lax.scan(
        chunk_step, state_BxHxKxV,
        (u_SxBxHxCxV, w_SxBxHxCxK, q_decayed_SxBxHxCxK, attention_SxBxHxCxC, k_to_end_SxBxHxCxK, state_decay_SxBxH))


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
