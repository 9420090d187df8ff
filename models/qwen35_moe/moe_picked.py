"""The routed experts of a decode step: only the picked experts' weights are read.

    routed(x)[n] = sum_k w[n, k] * (silu(x[n] @ G[e]) * (x[n] @ U[e])) @ D[e],   e = expert[n, k]

A decode step of 8 slots makes 64 (token, expert) picks of 256 experts; the grouped matmul (`moe.routed_experts`,
`ragged_dot`) streams every expert's weights. When the picks are few (`reads_picked_experts`) and the mesh keeps
every expert on every device, `SparseMoe` takes this path instead:
- on TPU, the Pallas kernel `mercury_kernels/picked_experts` reads each picked expert's weight tiles straight from the
  stacks (a block per pick, consecutive picks of one expert sharing it), per shard under `shard_map` with the
  intermediate dim split over tensor and the partial outputs summed (`psum`);
- elsewhere (and on a mesh that splits the weights' hidden dim), an XLA gather of each pick's matrices, [N, K, H, I],
  then the products.
In the scanned blocks the weights stay stacked over layers ([L, E, ...]) and the picks are read at (layer, expert):
slicing a layer's experts out of the stack inside the scan would copy all of them every step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mercury_jax.parallel import logical_partition_spec, partitioned_mesh
from mercury_kernels.picked_experts import pallas_picked_experts
from mercury_kernels.platform import target_platform
from models.qwen35_moe.config import Qwen35MoeConfig

MAX_PICKS_PER_EXPERT = 4  # on TPU: past this many picks per expert the kernel's per-pick 8-row products cost more
GATE_UP_AXES = ("layers", "experts", "embed", "expert_mlp")
DOWN_AXES = ("layers", "experts", "expert_mlp", "embed")


def reads_picked_experts(num_tokens: int, config: Qwen35MoeConfig) -> bool:
    """Whether `num_tokens` tokens' routed experts are computed pick by pick (`picked_experts`) rather than by the
    grouped matmul: not for moe_impl "dense" (the CPU test path) nor on a mesh that splits the experts; on TPU (the
    Pallas kernel, which reads each distinct picked expert once) up to 4 E picks; elsewhere (an XLA gather of every
    pick's matrices) fewer picks than experts."""
    if config.moe_impl == "dense":
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get("expert", 1) > 1:
        return False
    picks, experts = num_tokens * config.num_experts_per_tok, config.num_experts
    return picks <= MAX_PICKS_PER_EXPERT * experts if target_platform() == "tpu" else picks < experts


def picked_experts(x_NxH: jax.Array, expert_NxK: jax.Array, weight_NxK: jax.Array, gate_ExHxI: jax.Array,
                   up_ExHxI: jax.Array, down_ExIxH: jax.Array, layer: jax.Array | None = None, *,
                   impl: str = "auto") -> jax.Array:
    """routed(x) [N, H] reading only the picks' weights. With `layer`, the weights are stacks over layers
    ([L, E, H, I], ...) and the picks are read at (layer, expert). `impl`: "pallas" (the TPU kernel; interpret
    mode off TPU), "gather" (XLA), "auto" (pallas when tracing for TPU and the weights' layout allows it)."""
    if impl not in ("auto", "pallas", "gather"):
        raise ValueError(f"picked_experts impl {impl!r} is not one of auto, pallas, gather")
    if impl == "pallas" or (impl == "auto" and target_platform() == "tpu"):
        out = _pallas_per_shard(x_NxH, expert_NxK, weight_NxK, gate_ExHxI, up_ExHxI, down_ExIxH, layer)
        if out is not None:
            return out
    return gathered_experts(x_NxH, expert_NxK, weight_NxK, gate_ExHxI, up_ExHxI, down_ExIxH, layer)


def gathered_experts(x_NxH, expert_NxK, weight_NxK, gate_ExHxI, up_ExHxI, down_ExIxH, layer=None) -> jax.Array:
    """routed(x) by an XLA gather of each pick's expert matrices ([N, K, H, I]), then the products."""
    dt = x_NxH.dtype
    index = expert_NxK if layer is None else (layer, expert_NxK)
    gate_NxKxHxI, up_NxKxHxI, down_NxKxIxH = (w[index].astype(dt) for w in (gate_ExHxI, up_ExHxI, down_ExIxH))
    hidden_NxKxI = jax.nn.silu(jnp.einsum("nh,nkhi->nki", x_NxH, gate_NxKxHxI)) * jnp.einsum(
        "nh,nkhi->nki", x_NxH, up_NxKxHxI)
    return jnp.einsum("nkh,nk->nh", jnp.einsum("nki,nkih->nkh", hidden_NxKxI, down_NxKxIxH), weight_NxK)


def _pallas_per_shard(x_NxH, expert_NxK, weight_NxK, gate, up, down, layer):
    """The Pallas kernel per shard of the mesh being traced under (whole off a mesh); None when the weights' hidden
    dim or experts are split there (the kernel wants them whole per shard)."""
    if layer is None:
        gate, up, down, layer = gate[None], up[None], down[None], jnp.int32(0)
    mesh = partitioned_mesh()
    if mesh is None:
        return pallas_picked_experts(x_NxH, expert_NxK, weight_NxK, gate, up, down, layer)
    gate_spec = logical_partition_spec(GATE_UP_AXES, gate.shape, mesh)
    down_spec = logical_partition_spec(DOWN_AXES, down.shape, mesh)
    if any(gate_spec[:3]) or down_spec[0] or down_spec[1] or down_spec[3]:
        return None
    axis = gate_spec[3]

    def local(x, experts, weights, g, u, d, index):
        y = pallas_picked_experts(x, experts, weights, g, u, d, index, out_dtype=jnp.float32)
        return (y if axis is None else jax.lax.psum(y, axis)).astype(x.dtype)

    whole = PartitionSpec()
    return jax.shard_map(local, mesh=mesh, in_specs=(whole, whole, whole, gate_spec, gate_spec, down_spec, whole),
                         out_specs=whole, check_vma=False)(x_NxH, expert_NxK, weight_NxK, gate, up, down, layer)
