"""Model FLOPs counted by hand, the figures every bench sets beside XLA's cost analysis and the chips' peaks.

    forward:   2 N + causal attention per token     (N the active parameters: `active_parameters`)
    training:  3 x forward                           (the backward pass costs twice the forward)

N counts every parameter a token multiplies: all but the embedding table (a lookup) and the routed experts, and of
those k / E (top-k routing over E experts). Causal attention adds QK^T and PV over the full-attention layers at a
mean context of half the row; the Gated DeltaNet layers' state updates are linear in the heads and left to the
matmul count, except where rows split over `sequence` add a pass of the rule (`gdn_split_flops_per_token`).
"""
from __future__ import annotations

import numpy as np
from flax import nnx

from mercury_kernels.gated_delta.pallas import chunk_macs
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe.config import Qwen35MoeConfig


def active_parameters(cfg: Qwen35MoeConfig) -> tuple[int, int]:
    """(parameters used per token outside the embedding lookup, total parameters): routed experts count k / E."""
    model = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    active = total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        size = int(np.prod(leaf.get_value().shape, dtype=np.int64))
        total += size
        names = [str(p) for p in path]
        if any("embed" in n for n in names):
            continue
        routed = any(n.startswith("expert_") for n in names) and not any("shared" in n for n in names)
        active += size * cfg.num_experts_per_tok // cfg.num_experts if routed else size
    return active, total


def attention_flops_per_token(cfg: Qwen35MoeConfig, context: int) -> float:
    """Forward FLOPs of causal attention per token at mean context `context` / 2 (QK^T and PV) over the
    full-attention layers; the GDN layers' state updates are linear in the heads and left to the matmul count."""
    full_layers = sum(1 for kind in cfg.layer_types if kind == "full_attention")
    return full_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * context / 2


def forward_flops_per_token(cfg: Qwen35MoeConfig, context: int) -> float:
    """2 N (N the active parameters, routed experts at k / E) plus causal attention at mean context `context` / 2."""
    return 2 * active_parameters(cfg)[0] + attention_flops_per_token(cfg, context)


def training_flops_per_token(cfg: Qwen35MoeConfig, context: int) -> float:
    """A trained token: the forward and a backward of twice its cost, 3 x `forward_flops_per_token`."""
    return 3 * forward_flops_per_token(cfg, context)


def gdn_rule_flops_per_token(cfg: Qwen35MoeConfig, value_width: int) -> float:
    """Forward FLOPs a token of the gated delta rule costs over every GDN layer and value head, at value width
    `value_width` (V for the rule itself; V + K for the span maps' first pass of rows split over `sequence`,
    docs/MODEL.md §8): a chunk's multiply-adds by the Pallas kernel's own count (`chunk_macs`) over its C tokens,
    2 FLOPs each."""
    gdn_layers = sum(1 for kind in cfg.layer_types if kind != "full_attention")
    chunk = cfg.gdn_chunk_size
    per_macs = 2 * gdn_layers * cfg.linear_num_value_heads / chunk
    return per_macs * chunk_macs(chunk, cfg.linear_key_head_dim, value_width)
