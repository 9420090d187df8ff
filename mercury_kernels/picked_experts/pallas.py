"""Pallas TPU kernel: the routed experts of a few tokens, reading only the picked experts' weights from HBM.

    y[n] = sum_k w[n, k] * (silu(x[n] @ G[l, e]) * (x[n] @ U[l, e])) @ D[l, e],   e = expert[n, k]

The N K picks are sorted by expert; grid (picks P, intermediate tiles J). Grid step (p, j) has its pick's weight
tiles G[l, e_p, :, j], U[l, e_p, :, j] [H, bi] and D[l, e_p, j, :] [bi, H] brought in by the BlockSpecs' index maps
(the expert ids and the layer are scalar-prefetched), so a weight block is read only for a picked expert, and
consecutive picks of one expert (sorted) reuse the block already in VMEM when the intermediate dim is one tile
(bi = I, as on a tensor=4 replica of 35B-A3B: I / 4 = 128): HBM reads = the distinct experts hit, the figure the
decode's must-read estimate counts. Each step takes the 8 token rows holding its pick's token (N padded to a
multiple of 8), computes all 8 (MXU-shaped [8, H] x [H, bi] products: a decode step is bound by the weight reads,
not these FLOPs), accumulates [8, H] f32 over j in a scratch, and at the last j writes its token's row. The
k-weighted sum over a token's picks (tiny: [N K, H]) is done outside, in XLA. The declared cost counts the weight
tiles of the expected number of distinct experts P picks hit, E (1 - (1 - 1/E)^P) (uniform routing, the decode
must-read estimate's assumption; every pick's tiles when the intermediate dim takes several tiles).

VMEM per step (H = 2048, bi = 128, bf16 weights): 3 weight tiles x 512 KiB, double-buffered 3 MiB; the rows and
the accumulator 2 x 64 KiB. On a non-TPU backend the kernel runs in Pallas interpret mode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mercury_kernels.platform import target_platform

_F32 = jnp.float32
_ROWS = 8  # sublanes: the token rows are padded to a multiple of this


def pallas_picked_experts(x_NxH: jax.Array, expert_NxK: jax.Array, weight_NxK: jax.Array, gate_LxExHxI: jax.Array,
                          up_LxExHxI: jax.Array, down_LxExIxH: jax.Array, layer: jax.Array, *,
                          block_i: int = 128, out_dtype=None, interpret: bool | None = None) -> jax.Array:
    """y [N, H] in `out_dtype` (default: x's) as in the module docstring; the weights are stacks over layers and
    `layer` picks one (a per-layer [E, ...] weight: pass `w[None]` and layer 0)."""
    if interpret is None:
        interpret = target_platform() != "tpu"
    N, H = x_NxH.shape
    K = expert_NxK.shape[1]
    I = gate_LxExHxI.shape[-1]
    bi = block_i if I % block_i == 0 else I
    rows = -(-N // _ROWS) * _ROWS
    x_RxH = jnp.pad(x_NxH, ((0, rows - N), (0, 0)))
    expert_P = expert_NxK.reshape(N * K).astype(jnp.int32)
    order_P = jnp.argsort(expert_P, stable=True)
    token_P = (order_P // K).astype(jnp.int32)
    sorted_expert_P = expert_P[order_P]
    layer_1 = jnp.reshape(layer, (1,)).astype(jnp.int32)
    P, J = N * K, I // bi
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,  # sorted experts, their tokens, the layer
        grid=(P, J),
        in_specs=[
            pl.BlockSpec((_ROWS, H), lambda p, j, e, t, l: (t[p] // _ROWS, 0)),  # the 8 rows holding the token
            pl.BlockSpec((None, None, H, bi), lambda p, j, e, t, l: (l[0], e[p], 0, j)),
            pl.BlockSpec((None, None, H, bi), lambda p, j, e, t, l: (l[0], e[p], 0, j)),
            pl.BlockSpec((None, None, bi, H), lambda p, j, e, t, l: (l[0], e[p], j, 0)),
        ],
        out_specs=pl.BlockSpec((None, 1, H), lambda p, j, e, t, l: (p, 0, 0)),
        scratch_shapes=[pltpu.VMEM((_ROWS, H), _F32)],
    )
    itemsize = jnp.dtype(gate_LxExHxI.dtype).itemsize
    E = gate_LxExHxI.shape[1]
    fetched = E * (1 - (1 - 1 / E) ** P) if J == 1 else P  # one fetch per run of equal (sorted) experts
    cost = pl.CostEstimate(flops=P * 6 * _ROWS * H * I, transcendentals=P * _ROWS * I,
                           bytes_accessed=int(fetched * 3 * H * I * itemsize
                                              + P * (_ROWS * H * x_NxH.dtype.itemsize + H * 4)))
    out_Px1xH = pl.pallas_call(
        _kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((P, 1, H), _F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="picked_experts",
    )(sorted_expert_P, token_P, layer_1, x_RxH, gate_LxExHxI, up_LxExHxI, down_LxExIxH)
    out_PxH = jnp.zeros((P, H), _F32).at[order_P].set(out_Px1xH[:, 0])
    y_NxH = jnp.einsum("nkh,nk->nh", out_PxH.reshape(N, K, H), weight_NxK.astype(_F32))
    return y_NxH.astype(out_dtype or x_NxH.dtype)


def _kernel(expert_ref, token_ref, layer_ref, x_ref, gate_ref, up_ref, down_ref, out_ref, acc_ref):
    p, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    gate = jnp.dot(x, gate_ref[...], preferred_element_type=_F32)
    up = jnp.dot(x, up_ref[...], preferred_element_type=_F32)
    hidden = (jax.nn.silu(gate) * up).astype(down_ref.dtype)
    acc_ref[...] += jnp.dot(hidden, down_ref[...], preferred_element_type=_F32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        row = jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0) == token_ref[p] % _ROWS
        out_ref[...] = jnp.sum(jnp.where(row, acc_ref[...], 0.0), axis=0, keepdims=True)


__all__ = ["pallas_picked_experts"]
