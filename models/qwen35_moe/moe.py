"""Dropless sparse MoE of Qwen3.5 with a sigmoid-gated shared expert.

    p = softmax(x @ W_router) (fp32, over all E experts);  (w, e) = top_k(p);  w = w / sum(w)
    routed(x) = sum_i w_i * (silu(x @ G[e_i]) * (x @ U[e_i])) @ D[e_i]
    out = routed(x) + sigmoid(x @ w_shared_gate) * SwiGLU_shared(x)
Dropless: the N*k (token, expert) pairs are sorted by expert and multiplied with `jax.lax.ragged_dot` (a grouped
matmul, no capacity, no padding to a capacity), then unsorted and summed. Aux statistics for the Switch
load-balancing loss are returned so a caller can combine them across layers exactly as HF does.
Fewer (token, expert) picks than experts (a decode step: N k < E) and no expert split over the mesh: each pick's
expert matrices are read instead (`moe_picked.py`), so a step reads the experts it uses, not all of them.
moe_impl "blocked" runs the same sum as batched matmuls over expert-aligned row blocks (moe_blocked.py: for backends
whose ragged_dot is a dense rewrite, GPUs). moe_impl "ep" runs the routing and the routed sum expert-parallel under
shard_map over the context mesh (moe_ep.py), token-local, with the aux statistics summed over all shards
(whole-batch, as HF); the shared expert stays here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.moe_blocked import blocked_experts
from models.qwen35_moe.moe_ep import ep_moe
from models.qwen35_moe.moe_picked import picked_experts, reads_picked_experts
from models.qwen35_moe.params import cast, make_param, normal_init
from models.qwen35_moe.routing import route


class SparseMoe(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        H, E, I, Is = (config.hidden_size, config.num_experts, config.moe_intermediate_size,
                       config.shared_expert_intermediate_size)
        init, pdt = normal_init(config.initializer_range), config.weight_dtype
        self.router = make_param(rngs, init, (H, E), ("embed", "experts_router"), pdt)
        self.expert_gate = make_param(rngs, init, (E, H, I), ("experts", "embed", "expert_mlp"), pdt)
        self.expert_up = make_param(rngs, init, (E, H, I), ("experts", "embed", "expert_mlp"), pdt)
        self.expert_down = make_param(rngs, init, (E, I, H), ("experts", "expert_mlp", "embed"), pdt)
        self.shared_gate_proj = make_param(rngs, init, (H, Is), ("embed", "mlp"), pdt)
        self.shared_up_proj = make_param(rngs, init, (H, Is), ("embed", "mlp"), pdt)
        self.shared_down_proj = make_param(rngs, init, (Is, H), ("mlp", "embed"), pdt)
        self.shared_expert_gate = make_param(rngs, init, (H, 1), ("embed", None), pdt)

    def __call__(self, x_BxTxH: jax.Array, stacked_experts: tuple | None = None) -> tuple[jax.Array, dict]:
        """(output [B, T, H], routing statistics). `stacked_experts`: (gate, up, down stacked over the scanned
        layers, this layer's index), the weights a few picks gather from (`picked_experts`)."""
        cfg = self.config
        dt = x_BxTxH.dtype
        B, T, H = x_BxTxH.shape
        x_NxH = x_BxTxH.reshape(B * T, H)
        picked = reads_picked_experts(x_NxH.shape[0], cfg)
        experts = lambda: (cast(self.expert_gate, dt), cast(self.expert_up, dt), cast(self.expert_down, dt))  # noqa: E731
        if cfg.moe_impl == "ep" and not picked:
            routed_NxH, aux = ep_moe(x_NxH, cast(self.router, dt), *experts(), top_k=cfg.num_experts_per_tok,
                                     round_factor=cfg.moe_ep_round_factor)
        else:
            probs_NxE, top_w_NxK, top_e_NxK = route(x_NxH, cast(self.router, dt), cfg.num_experts_per_tok)
            if picked and stacked_experts is not None:
                *stacks, layer = stacked_experts
                routed_NxH = picked_experts(x_NxH, top_e_NxK, top_w_NxK, *stacks, layer=layer)
            elif picked:
                routed_NxH = picked_experts(x_NxH, top_e_NxK, top_w_NxK, self.expert_gate[...],
                                            self.expert_up[...], self.expert_down[...])
            else:
                routed = {"dense": dense_experts, "blocked": blocked_experts}.get(cfg.moe_impl, routed_experts)
                routed_NxH = routed(x_NxH, top_e_NxK, top_w_NxK, *experts())
            aux = {
                "expert_counts_E": jnp.zeros((cfg.num_experts,), jnp.float32).at[top_e_NxK.reshape(-1)].add(1.0),
                "router_prob_sum_E": jnp.sum(probs_NxE, axis=0),
            }
        shared_NxH = (jax.nn.silu(x_NxH @ cast(self.shared_gate_proj, dt)) * (x_NxH @ cast(self.shared_up_proj, dt))
                      ) @ cast(self.shared_down_proj, dt)
        shared_NxH = jax.nn.sigmoid(x_NxH @ cast(self.shared_expert_gate, dt)) * shared_NxH
        return (routed_NxH + shared_NxH).reshape(B, T, H), aux


def routed_experts(x_NxH: jax.Array, expert_NxK: jax.Array, weight_NxK: jax.Array, gate_ExHxI: jax.Array,
                   up_ExHxI: jax.Array, down_ExIxH: jax.Array) -> jax.Array:
    """sum_k weight[n, k] * Expert_{expert[n, k]}(x[n]) via sort-by-expert and grouped matmuls (dropless)."""
    N, K = expert_NxK.shape
    E = gate_ExHxI.shape[0]
    flat_expert_M = expert_NxK.reshape(N * K)
    order_M = jnp.argsort(flat_expert_M, stable=True)
    token_M = order_M // K
    x_MxH = x_NxH[token_M]
    group_sizes_E = jnp.bincount(flat_expert_M, length=E).astype(jnp.int32)
    gate_MxI = jax.lax.ragged_dot(x_MxH, gate_ExHxI, group_sizes_E)
    up_MxI = jax.lax.ragged_dot(x_MxH, up_ExHxI, group_sizes_E)
    out_MxH = jax.lax.ragged_dot(jax.nn.silu(gate_MxI) * up_MxI, down_ExIxH, group_sizes_E)
    unsorted_MxH = jnp.zeros_like(out_MxH).at[order_M].set(out_MxH)
    unsorted_NxKxH = unsorted_MxH.reshape(N, K, -1)
    return jnp.einsum("nkh,nk->nh", unsorted_NxKxH, weight_NxK)


def dense_experts(x_NxH: jax.Array, expert_NxK: jax.Array, weight_NxK: jax.Array, gate_ExHxI: jax.Array,
                  up_ExHxI: jax.Array, down_ExIxH: jax.Array) -> jax.Array:
    """The same sum as `routed_experts`, computed for every expert and weighted by a dense [N, E] routing matrix
    (zero for experts a token did not pick). E / k times the FLOPs, but plain matmuls: faster for the few
    experts of test-sized models on CPU, where `ragged_dot` has no fast kernel."""
    E = gate_ExHxI.shape[0]
    routing_NxE = jnp.sum(jax.nn.one_hot(expert_NxK, E, dtype=weight_NxK.dtype) * weight_NxK[..., None], axis=1)
    hidden_NxExI = jax.nn.silu(jnp.einsum("nh,ehi->nei", x_NxH, gate_ExHxI)) * jnp.einsum("nh,ehi->nei", x_NxH,
                                                                                         up_ExHxI)
    return jnp.einsum("nei,eih,ne->nh", hidden_NxExI, down_ExIxH, routing_NxE)


def load_balancing_loss(expert_counts_E: jax.Array, router_prob_sum_E: jax.Array, num_tokens: jax.Array,
                        num_experts: int) -> jax.Array:
    """Switch aux loss as HF computes it: E * sum_e (counts_e / N) * (prob_sum_e / N), sums over all layers."""
    return num_experts * jnp.sum((expert_counts_E / num_tokens) * (router_prob_sum_E / num_tokens))
