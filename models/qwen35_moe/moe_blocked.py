"""Dropless routed experts as a batched matmul over expert-aligned row blocks: exact, and fast on any backend.

Where `jax.lax.ragged_dot` has no grouped kernel (XLA on GPU rewrites it into a dense masked dot whose operand is E
times the sorted rows, [E, N k, H]: 200 GB for one 24,576-token row of the 35B-A3B, and its weight gradient as
large), the M = N k (token, expert) picks are laid out so that each expert's rows start on a multiple of b:

    g_e = picks of expert e,  P_e = b * sum_{e' < e} ceil(g_e' / b)   (the expert's first padded row)
    the r-th pick of expert e goes to row  P_e + r;  rows no pick reaches are zero

Row block j (rows j b .. j b + b - 1) then belongs to one expert, x(j) = the e with P_e <= j b < P_e + b ceil(g_e / b),
and every expert matrix product is one batched matmul over the blocks:

    Y[j] = X[j] @ W[x(j)],   X: [nb, b, H],  W[x]: [nb, H, I],  nb = ceil(M / b) + E (a bound on sum_e ceil(g_e / b))

Blocks past the last expert's take expert E - 1 and zero rows, so they add zero (and zero gradient). The gradient is
the batched matmul's; the weights' flows through the gather's transpose, a scatter-add into [E, H, I]. Cost: nb b
rows of matmul (at most M + E b: 16% more than M for the 35B-A3B's 24,576-token row, b = 128), and the gathered
weights, nb H I a matrix (3.8 GB bf16 for that row), held once per matrix per layer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK_ROWS = 128  # rows of one block: a multiple of the tensor cores' tile, small enough to waste little padding


def expert_blocks(expert_M: jax.Array, num_experts: int, block_rows: int) -> tuple[jax.Array, jax.Array, int]:
    """(row_M: each pick's row in the padded layout, block_expert_B: each block's expert, number of blocks nb)."""
    M = expert_M.shape[0]
    b = block_rows
    nb = -(-M // b) + num_experts
    order_M = jnp.argsort(expert_M, stable=True)
    sorted_expert_M = expert_M[order_M]
    group_sizes_E = jnp.bincount(expert_M, length=num_experts).astype(jnp.int32)
    start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    padded_E = -(-group_sizes_E // b) * b
    padded_end_E = jnp.cumsum(padded_E)
    padded_start_E = padded_end_E - padded_E
    sorted_row_M = padded_start_E[sorted_expert_M] + jnp.arange(M, dtype=jnp.int32) - start_E[sorted_expert_M]
    row_M = jnp.zeros((M,), jnp.int32).at[order_M].set(sorted_row_M)
    block_start_B = jnp.arange(nb, dtype=jnp.int32) * b
    block_expert_B = jnp.minimum(jnp.searchsorted(padded_end_E, block_start_B, side="right"), num_experts - 1)
    return row_M, block_expert_B.astype(jnp.int32), nb


def blocked_experts(x_NxH: jax.Array, expert_NxK: jax.Array, weight_NxK: jax.Array, gate_ExHxI: jax.Array,
                    up_ExHxI: jax.Array, down_ExIxH: jax.Array, block_rows: int = BLOCK_ROWS) -> jax.Array:
    """sum_k weight[n, k] * Expert_{expert[n, k]}(x[n]), each expert's SwiGLU as batched matmuls over row blocks."""
    N, K = expert_NxK.shape
    E, H, _ = gate_ExHxI.shape
    b = block_rows
    row_M, block_expert_B, nb = expert_blocks(expert_NxK.reshape(N * K), E, b)
    token_M = jnp.arange(N * K, dtype=jnp.int32) // K
    x_BxbxH = jnp.zeros((nb * b, H), x_NxH.dtype).at[row_M].set(x_NxH[token_M]).reshape(nb, b, H)
    gate_BxbxI = jnp.einsum("jrh,jhi->jri", x_BxbxH, gate_ExHxI[block_expert_B])
    up_BxbxI = jnp.einsum("jrh,jhi->jri", x_BxbxH, up_ExHxI[block_expert_B])
    out_BxbxH = jnp.einsum("jri,jih->jrh", jax.nn.silu(gate_BxbxI) * up_BxbxI, down_ExIxH[block_expert_B])
    out_NxKxH = out_BxbxH.reshape(nb * b, H)[row_M].reshape(N, K, H)
    return jnp.einsum("nkh,nk->nh", out_NxKxH, weight_NxK)
