"""Pallas TPU kernels for the chunked gated delta rule: forward and backward, wrapped in `jax.custom_vjp`.

Same recurrence and chunk algebra as `chunked.py` (WY / UT form; see its docstring for M, L, Tinv, U, W, P and the
carry mask c). One grid step is one chunk of C tokens of one (batch, head): grid (B, H, N) with the chunk axis
sequential ("arbitrary") and the state S (K x V, float32) carried from chunk to chunk in a VMEM scratch buffer.

Forward, per grid step: load q, k [C, K], v [C, V] (bf16 or f32, promoted to f32 in VMEM) and the per-position
rows g, beta, document index and carry mask [1, C]; form M, L and (I + L)^-1 with C x C matmuls; write O [C, V]
(f32) and, when a gradient is needed, the chunk's incoming state S [K, V]; update S in the scratch. The last chunk
writes the final state.

Backward, chunks in reverse order, carrying dS (K x V, f32) in VMEM: the chunk's forward is recomputed from its
saved incoming state (never a [T, K, V] history: one state per chunk, K V / C floats per token, 256 at K = V = 128,
C = 64) and differentiated with `jax.vjp` inside the kernel, giving dq, dk, dv, dg, dbeta for the chunk and the dS
passed to the chunk before it; the first chunk's dS is the initial state's gradient.

(I + L)^-1 in the kernel is the recursive block inversion of `chunked.unit_lower_triangular_inverse` written on the
whole C x C matrix with masks instead of reshapes (MXU-shaped 2-D matmuls only): with X_b the inverse of the
block-diagonal part at block size b, X_2b = X_b - X_b (L restricted to the lower-left b x b quarter of each 2b
block) X_b; log2(C) levels, the same products as the reshaped form plus zeros.

VMEM per grid step (K = V = 128, C = 64, f32 inputs; each pipelined block double-buffered): q, k, v 3 x 2 x 32 KiB,
o 2 x 32 KiB, the saved state 2 x 64 KiB, the state scratch 64 KiB, a dozen C x C / C x K temporaries (16-32 KiB
each): ~0.8 MiB. The v5p AOT compile (`mercury_jax/bench/gated_delta_aot.py`) fits it in the default scoped VMEM
without a `vmem_limit_bytes` override, and a chip's VMEM (tens of MiB) would hold many times more, so C = 64 is not
VMEM-bound. C = 64 fills half of the 128-wide MXU in the C x C products; it is the model's `gdn_chunk_size` and
keeps the C^3 log C inverse (12 C x C x C matmuls) below the C K V state products (3 C K V per chunk).

Semantics, padding and segment handling are those of `chunked.py`: T is padded to a multiple of C with g = beta =
k = 0 steps; `segment_ids_BxT` restarts the state at every id change; the initial state reaches the first document
only. On a non-TPU backend the kernels run in Pallas interpret mode (same kernel code, executed by XLA).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mercury_kernels.gated_delta.reference import segment_starts
from mercury_kernels.platform import target_platform

_F32 = jnp.float32
_PRECISION = jax.lax.Precision.HIGHEST  # fp32 semantics; TPU's default f32 matmul rounds operands to bf16.


def pallas_gated_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, *, initial_state_BxHxKxV=None,
                            segment_ids_BxT=None, chunk_size=64, interpret=None):
    """The gated delta rule by the Pallas kernels; returns (o_BxTxHxV, final_state_BxHxKxV), float32.

    Contract as `chunked_gated_delta_rule`. q, k, v may be bf16 or f32 (their gradients come back in that dtype);
    all arithmetic is f32. `interpret` (static): None runs the Mosaic kernel when tracing for TPU (`target_platform`:
    the mesh context's devices, else the default backend) and interpret mode elsewhere.
    """
    batch, time, heads, key_dim = k_BxTxHxK.shape
    value_dim = v_BxTxHxV.shape[-1]
    chunk = int(chunk_size)
    num_chunks = -(-time // chunk)
    padded_time = num_chunks * chunk
    if interpret is None:
        interpret = target_platform() != "tpu"
    if not interpret and chunk % 8:
        raise ValueError(f"pallas_gated_delta_rule: chunk_size {chunk} is not a multiple of 8, which Mosaic needs for "
                         f"the [C, K] blocks (f32 sublane tiling); use chunk_size 64 (the model's default) or 32")
    if initial_state_BxHxKxV is None:
        initial_state_BxHxKxV = jnp.zeros((batch, heads, key_dim, value_dim), _F32)
    initial_state_BxHxKxV = jnp.asarray(initial_state_BxHxKxV, _F32)

    def head_major(x_BxTxHx_, dtype=None):
        """[B, T, H, D] -> [B, H, Tp, D], zero-padded along T."""
        x = jnp.asarray(x_BxTxHx_) if dtype is None else jnp.asarray(x_BxTxHx_, dtype)
        x = jnp.pad(x, [(0, 0), (0, padded_time - time), (0, 0), (0, 0)])
        return jnp.swapaxes(x, 1, 2)

    def rows(x_BxTxH):
        """[B, T, H] -> [B, H, N, 1, C] float32 rows, zero-padded along T."""
        x = jnp.pad(jnp.asarray(x_BxTxH, _F32), [(0, 0), (0, padded_time - time), (0, 0)])
        return jnp.moveaxis(x.reshape(batch, num_chunks, chunk, heads), 3, 1)[:, :, :, None, :]

    document_BxT = jnp.cumsum(segment_starts(segment_ids_BxT, (batch, time)), axis=1, dtype=jnp.int32)
    document_BxT = jnp.pad(document_BxT, ((0, 0), (0, padded_time - time)), mode="edge")
    document_BxNxC = document_BxT.reshape(batch, num_chunks, chunk)
    previous_document_BxN = jnp.concatenate([document_BxNxC[:, :1, 0], document_BxNxC[:, :-1, -1]], axis=1)
    carries_in_BxNxC = document_BxNxC == previous_document_BxN[..., None]
    # Document indices are exact in f32 up to 2^24 positions; the kernel compares them for equality.
    positions_Bx2xNx1xC = jnp.stack([document_BxNxC.astype(_F32), carries_in_BxNxC.astype(_F32)], axis=1)[
        :, :, :, None, :]

    o_BxHxTpxV, final_state_BxHxKxV = _gated_delta(
        head_major(q_BxTxHxK), head_major(k_BxTxHxK), head_major(v_BxTxHxV), rows(g_BxTxH), rows(beta_BxTxH),
        initial_state_BxHxKxV, positions_Bx2xNx1xC, chunk, bool(interpret))
    return jnp.swapaxes(o_BxHxTpxV, 1, 2)[:, :time], final_state_BxHxKxV


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _gated_delta(q, k, v, g_rows, beta_rows, initial_state, positions, chunk, interpret):
    o, final_state, _ = _forward_call(q, k, v, g_rows, beta_rows, initial_state, positions, chunk, interpret,
                                      save_states=False)
    return o, final_state


def _gated_delta_fwd(q, k, v, g_rows, beta_rows, initial_state, positions, chunk, interpret):
    o, final_state, states = _forward_call(q, k, v, g_rows, beta_rows, initial_state, positions, chunk, interpret,
                                           save_states=True)
    return (o, final_state), (q, k, v, g_rows, beta_rows, positions, states)


def _gated_delta_bwd(chunk, interpret, residuals, cotangents):
    positions = residuals[5]
    d_o, d_final_state = cotangents
    dq, dk, dv, dg, dbeta, d_initial_state = _backward_call(
        residuals, d_o.astype(_F32), d_final_state.astype(_F32), chunk, interpret)
    return dq, dk, dv, dg, dbeta, d_initial_state, jnp.zeros_like(positions)


_gated_delta.defvjp(_gated_delta_fwd, _gated_delta_bwd)


def _specs(batch, heads, num_chunks, chunk, key_dim, value_dim, reverse):
    """BlockSpecs of the per-chunk operands; `reverse` walks the chunk axis from the last chunk to the first."""
    at = (lambda n: num_chunks - 1 - n) if reverse else (lambda n: n)
    return dict(
        qk=pl.BlockSpec((None, None, chunk, key_dim), lambda b, h, n: (b, h, at(n), 0)),
        v=pl.BlockSpec((None, None, chunk, value_dim), lambda b, h, n: (b, h, at(n), 0)),
        row=pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, n: (b, h, at(n), 0, 0)),
        document=pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, n: (b, 0, at(n), 0, 0)),
        carry=pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, n: (b, 1, at(n), 0, 0)),
        state=pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0)),
        chunk_state=pl.BlockSpec((None, None, None, key_dim, value_dim), lambda b, h, n: (b, h, at(n), 0, 0)),
    )


def chunk_macs(chunk, key_dim, value_dim):
    """Multiply-adds of `_chunk_forward`: the pairwise decay C^3, the inverse 2 log2(C) C^3, the C x C products
    k k^T, q k^T, W, U and A u (C^2 (3K + 2V)), and the state products w S, q S, k^T u (3 C K V)."""
    levels = max(chunk - 1, 1).bit_length()
    return chunk ** 3 * (1 + 2 * levels) + chunk ** 2 * (3 * key_dim + 2 * value_dim) + 3 * chunk * key_dim * value_dim


def _cost(grid_steps, chunk, key_dim, value_dim, operands, outputs, backward):
    """What the kernel does, for XLA's cost analysis (a Mosaic call is opaque to it): 2 FLOPs per multiply-add;
    the backward recomputes the chunk and differentiates it (~3x the forward's products, 2x its exps)."""
    passes = 3 if backward else 1
    flops = 2 * passes * grid_steps * chunk_macs(chunk, key_dim, value_dim)
    transcendentals = (2 if backward else 1) * grid_steps * (chunk * chunk + 2 * chunk)
    nbytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in (*operands, *outputs))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(nbytes))


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _forward_call(q, k, v, g_rows, beta_rows, initial_state, positions, chunk, interpret, save_states):
    batch, heads, padded_time, key_dim = k.shape
    value_dim = v.shape[-1]
    num_chunks = padded_time // chunk
    spec = _specs(batch, heads, num_chunks, chunk, key_dim, value_dim, reverse=False)
    out_shape = [jax.ShapeDtypeStruct((batch, heads, padded_time, value_dim), _F32),
                 jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), _F32)]
    out_specs = [spec["v"], spec["state"]]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, num_chunks, key_dim, value_dim), _F32))
        out_specs.append(spec["chunk_state"])
    outputs = pl.pallas_call(
        functools.partial(_forward_kernel, save_states=save_states),
        grid=(batch, heads, num_chunks),
        in_specs=[spec["qk"], spec["qk"], spec["v"], spec["row"], spec["row"], spec["document"], spec["carry"],
                  spec["state"]],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), _F32)],
        compiler_params=_compiler_params(),
        interpret=interpret,
        cost_estimate=_cost(batch * heads * num_chunks, chunk, key_dim, value_dim,
                            (q, k, v, g_rows, beta_rows, positions, initial_state), out_shape, backward=False),
        name="gated_delta_forward",
    )(q, k, v, g_rows, beta_rows, positions, positions, initial_state)
    return outputs[0], outputs[1], (outputs[2] if save_states else None)


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, document_ref, carry_ref, initial_state_ref, *refs,
                    save_states):
    if save_states:
        o_ref, final_state_ref, chunk_state_ref, state_scratch = refs
    else:
        o_ref, final_state_ref, state_scratch = refs
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_scratch[...] = initial_state_ref[...]

    state = state_scratch[...]
    if save_states:
        chunk_state_ref[...] = state
    o, new_state = _chunk_forward(
        state, q_ref[...].astype(_F32), k_ref[...].astype(_F32), v_ref[...].astype(_F32), g_ref[...],
        beta_ref[...], document_ref[...], carry_ref[...])
    o_ref[...] = o
    state_scratch[...] = new_state

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_state_ref[...] = new_state


def _backward_call(residuals, d_o, d_final_state, chunk, interpret):
    """The backward kernel over the chunks from the last: `residuals` the forward's (q, k, v, g rows, beta rows,
    positions, each chunk's entering state), the cotangents of o and of the final state in float32."""
    q, k, v, g_rows, beta_rows, positions, states = residuals
    batch, heads, padded_time, key_dim = k.shape
    value_dim = v.shape[-1]
    num_chunks = padded_time // chunk
    spec = _specs(batch, heads, num_chunks, chunk, key_dim, value_dim, reverse=True)
    # dq, dk, dv in their inputs' dtype (f32 inside the kernel): no f32 copy of a bf16 input's gradient in HBM
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g_rows.shape, _F32),
                 jax.ShapeDtypeStruct(beta_rows.shape, _F32),
                 jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), _F32)]
    return pl.pallas_call(
        _backward_kernel,
        grid=(batch, heads, num_chunks),
        in_specs=[spec["qk"], spec["qk"], spec["v"], spec["row"], spec["row"], spec["document"], spec["carry"],
                  spec["chunk_state"], spec["v"], spec["state"]],
        out_specs=[spec["qk"], spec["qk"], spec["v"], spec["row"], spec["row"], spec["state"]],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), _F32)],
        compiler_params=_compiler_params(),
        interpret=interpret,
        cost_estimate=_cost(batch * heads * num_chunks, chunk, key_dim, value_dim,
                            (q, k, v, g_rows, beta_rows, positions, states, d_o, d_final_state), out_shape,
                            backward=True),
        name="gated_delta_backward",
    )(q, k, v, g_rows, beta_rows, positions, positions, states, d_o, d_final_state)


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, document_ref, carry_ref, chunk_state_ref, d_o_ref,
                     d_final_state_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_initial_state_ref,
                     d_state_scratch):
    step = pl.program_id(2)  # chunk num_chunks - 1 - step

    @pl.when(step == 0)
    def _():
        d_state_scratch[...] = d_final_state_ref[...]

    document, carry = document_ref[...], carry_ref[...]

    def chunk_forward(state, q, k, v, g, beta):
        return _chunk_forward(state, q, k, v, g, beta, document, carry)

    _, chunk_vjp = jax.vjp(chunk_forward, chunk_state_ref[...], q_ref[...].astype(_F32), k_ref[...].astype(_F32),
                           v_ref[...].astype(_F32), g_ref[...], beta_ref[...])
    d_state, dq, dk, dv, dg, dbeta = chunk_vjp((d_o_ref[...], d_state_scratch[...]))
    dq_ref[...], dk_ref[...], dv_ref[...] = (dq.astype(dq_ref.dtype), dk.astype(dk_ref.dtype),
                                             dv.astype(dv_ref.dtype))
    dg_ref[...], dbeta_ref[...] = dg, dbeta
    d_state_scratch[...] = d_state

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        d_initial_state_ref[...] = d_state


def _dot(a, b):
    return jnp.dot(a, b, precision=_PRECISION, preferred_element_type=_F32)


def _dot_nt(a, b):
    """a @ b^T, contracting the last axes (the MXU's native transposed-rhs form)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_PRECISION, preferred_element_type=_F32)


def _chunk_forward(state_KxV, q_CxK, k_CxK, v_CxV, g_1xC, beta_1xC, document_1xC, carry_1xC):
    """One chunk of the gated delta rule in 2-D ops: returns (o_CxV, state after the chunk).

    `chunked._block_step` for one (batch, head, chunk), with rows ([1, C]) of g, beta, document index and carry mask
    turned into columns by a masked lane reduction (no transposes).
    """
    chunk = q_CxK.shape[0]
    r_CxC = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    s_CxC = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    diagonal_CxC = r_CxC == s_CxC

    def column(row_1xC):
        return jnp.sum(jnp.where(diagonal_CxC, row_1xC, 0.0), axis=1, keepdims=True)

    # D[r, s] = sum_{s < j <= r} g_j, summed directly (see chunked._pairwise_log_decay); Gamma_r = sum_{j <= r} g_j.
    g_up_to_r_CxC = jnp.where(s_CxC <= r_CxC, g_1xC, 0.0)
    log_decay_CxC = _dot(g_up_to_r_CxC, (r_CxC > s_CxC).astype(_F32))
    gamma_Cx1 = jnp.sum(g_up_to_r_CxC, axis=1, keepdims=True)
    beta_Cx1, document_Cx1, carry_Cx1 = column(beta_1xC), column(document_1xC), column(carry_1xC)

    coupled_CxC = (r_CxC >= s_CxC) & (document_Cx1 == document_1xC)
    decay_CxC = _masked_exp(log_decay_CxC, coupled_CxC)
    k_beta_CxK = k_CxK * beta_Cx1
    lower_CxC = jnp.where(r_CxC > s_CxC, _dot_nt(k_beta_CxK, k_CxK) * decay_CxC, 0.0)
    system_inverse_CxC = _unit_lower_triangular_inverse(lower_CxC, r_CxC, s_CxC)
    carry_weight_Cx1 = jnp.where(carry_Cx1 > 0.5, jnp.exp(gamma_Cx1), 0.0)
    u_CxV = _dot(system_inverse_CxC, v_CxV * beta_Cx1)
    w_CxK = _dot(system_inverse_CxC, k_beta_CxK * carry_weight_Cx1)
    attention_CxC = _dot_nt(q_CxK, k_CxK) * decay_CxC

    new_v_CxV = u_CxV - _dot(w_CxK, state_KxV)
    o_CxV = _dot(q_CxK * carry_weight_Cx1, state_KxV) + _dot(attention_CxC, new_v_CxV)
    in_last_document_1xC = document_1xC == document_1xC[:, chunk - 1:]
    to_end_Cx1 = column(_masked_exp(log_decay_CxC[chunk - 1:, :], in_last_document_1xC))
    state_decay_1x1 = carry_weight_Cx1[chunk - 1:, :]
    new_state_KxV = state_decay_1x1 * state_KxV + _dot((k_CxK * to_end_Cx1).T, new_v_CxV)
    return o_CxV, new_state_KxV


def _unit_lower_triangular_inverse(lower_CxC, r_CxC, s_CxC):
    """(I + L)^-1 for strictly lower-triangular L [C, C] by recursive block inversion on the whole matrix.

    X_1 = I;  X_2b = X_b - X_b (L * Q_b) X_b, with Q_b selecting row r, column s in the same 2b-block, r in its
    lower half and s in its upper half; X_b is block-diagonal, so this is [[A^-1, 0], [-D^-1 X A^-1, D^-1]].
    """
    chunk = lower_CxC.shape[0]
    inverse_CxC = (r_CxC == s_CxC).astype(_F32)
    block = 1
    while block < chunk:
        shift = block.bit_length() - 1
        same_pair = jnp.right_shift(r_CxC, shift + 1) == jnp.right_shift(s_CxC, shift + 1)
        quarter = same_pair & ((jnp.right_shift(r_CxC, shift) & 1) == 1) & ((jnp.right_shift(s_CxC, shift) & 1) == 0)
        inverse_CxC = inverse_CxC - _dot(_dot(inverse_CxC, jnp.where(quarter, lower_CxC, 0.0)), inverse_CxC)
        block *= 2
    return inverse_CxC


def _masked_exp(exponent, mask):
    """exp(exponent) where mask, else 0, with the masked exponent replaced before exp (no inf, no nan gradient)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0.0)), 0.0)
