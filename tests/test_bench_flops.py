"""The benches' hand counts of model FLOPs (`bench/flops.py`) against counts done by hand on a one-layer model,
and the released model's parameter counts against its name."""
from __future__ import annotations

import pytest

from mercury_jax.bench import flops
from mercury_kernels.gated_delta.pallas import chunk_macs
from models.qwen35_moe.config import PRESETS, tiny

# one full-attention layer: hidden 64, 4 query heads + 2 KV heads of 16, 8 experts top-2 (intermediate 32), a shared
# expert of 48, vocabulary 512, untied head
ONE_LAYER = tiny(num_hidden_layers=1, full_attention_interval=1)
EMBED = 512 * 64
HEAD = 64 * 512
NORMS = 64 + 64 + 64                                   # input, post-attention, final
ATTENTION = 64 * 4 * 32 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 16 + 16  # gated q (2 x head dim), k, v, o, q/k norms
ROUTER = 64 * 8
EXPERTS = 3 * 8 * 64 * 32                              # gate, up, down of each of 8 experts
SHARED = 3 * 64 * 48 + 64                              # gate, up, down and its sigmoid gate


def test_active_parameters_by_hand():
    active, total = flops.active_parameters(ONE_LAYER)
    assert total == EMBED + HEAD + NORMS + ATTENTION + ROUTER + EXPERTS + SHARED == 141_088
    # the embedding is a lookup (not counted); a token multiplies 2 of the 8 routed experts
    assert active == HEAD + NORMS + ATTENTION + ROUTER + EXPERTS * 2 // 8 + SHARED == 71_456


def test_attention_and_forward_flops_by_hand():
    # QK^T and PV: 2 FLOPs a multiply-add x 2 products x 4 heads x 16 dims x a mean context of 1,000 / 2
    assert flops.attention_flops_per_token(ONE_LAYER, 1000) == 2 * 2 * 4 * 16 * 500 == 128_000
    assert flops.attention_flops_per_token(tiny(), 1000) == 128_000  # 4 layers, one of them full attention
    assert flops.forward_flops_per_token(ONE_LAYER, 1000) == 2 * 71_456 + 128_000
    assert flops.training_flops_per_token(ONE_LAYER, 1000) == 3 * (2 * 71_456 + 128_000)


def test_gdn_rule_flops_by_hand():
    """tiny(): 3 GDN layers of 4 value heads, K = V = 16, chunk 64; a chunk's multiply-adds are the pairwise decay
    C^3, the inverse 2 log2(C) C^3, the C x C products C^2 (3K + 2V) and the state products 3 C K V."""
    cfg = tiny()
    assert cfg.gdn_chunk_size == 64
    macs = 64 ** 3 * (1 + 2 * 6) + 64 ** 2 * (3 * 16 + 2 * 16) + 3 * 64 * 16 * 16
    assert chunk_macs(64, 16, 16) == macs == 3_784_704
    assert flops.gdn_rule_flops_per_token(cfg, 16) == 2 * 3 * 4 / 64 * macs
    wider = 64 ** 3 * 13 + 64 ** 2 * (3 * 16 + 2 * 32) + 3 * 64 * 16 * 32  # the span maps' pass at V + K = 32
    assert flops.gdn_rule_flops_per_token(cfg, 32) == pytest.approx(2 * 3 * 4 / 64 * wider)


def test_active_parameters_of_the_released_model():
    """35B-A3B: ~35B parameters, ~3B used per token (the name's claim; routed experts count 8 of 256)."""
    active, total = flops.active_parameters(PRESETS["qwen3.5-35b-a3b"]())
    assert 34e9 < total < 36.5e9
    assert 2.5e9 < active < 3.6e9
