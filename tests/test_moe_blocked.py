"""Routed experts as batched matmuls over expert-aligned row blocks (`moe_blocked.py`), against the grouped matmul.

- The padded layout: every pick lands on its own row, each expert's rows start on a block boundary, a block's expert
  owns every pick in it, and the block count bounds the layout (hand-checked on a small case).
- `blocked_experts` equals `routed_experts` (sort + ragged_dot) in fp32 (1e-5 relative: the same products, summed
  in another order) with empty experts, a group exactly one block long, more picks than one block and fewer, and
  its gradients with respect to the input, the routing weights and the three expert stacks equal the reference's.
- A model with moe_impl "blocked" gives the "ragged" model's logits (1e-5).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.moe import routed_experts
from models.qwen35_moe.moe_blocked import blocked_experts, expert_blocks


def test_the_layout_gives_each_expert_whole_blocks():
    expert_M = jnp.asarray([2, 0, 2, 2, 0, 3, 2, 2], jnp.int32)  # expert 0: 2 picks, 1: none, 2: 5, 3: 1
    row_M, block_expert_B, nb = expert_blocks(expert_M, num_experts=4, block_rows=4)
    assert nb == 2 + 4
    # expert 0 -> rows 0, 1 (block 0); expert 2 -> rows 4..8 (blocks 1, 2); expert 3 -> row 12 (block 3)
    np.testing.assert_array_equal(row_M, [4, 0, 5, 6, 1, 12, 7, 8])
    np.testing.assert_array_equal(block_expert_B, [0, 2, 2, 3, 3, 3])
    assert np.all(np.asarray(block_expert_B)[np.asarray(row_M) // 4] == np.asarray(expert_M))


def _case(N, K, E, seed, skip=()):
    rng = np.random.RandomState(seed)
    H, inner = 16, 12
    allowed = [e for e in range(E) if e not in skip]
    picks = np.stack([rng.choice(allowed, K, replace=False) for _ in range(N)])
    args = (jnp.asarray(rng.randn(N, H), jnp.float32), jnp.asarray(picks, jnp.int32),
            jnp.asarray(rng.rand(N, K), jnp.float32),
            *(jnp.asarray(rng.randn(*s), jnp.float32) for s in ((E, H, inner), (E, H, inner), (E, inner, H))))
    return args


@pytest.mark.parametrize("N,K,E,block_rows,skip", [
    (3, 2, 8, 4, ()),            # 6 picks, fewer than the blocks' rows of some experts
    (20, 2, 4, 8, (1,)),         # 40 picks over 3 experts, expert 1 empty, groups span several blocks
    (16, 1, 2, 8, ()),           # 16 picks of 2 experts: groups may fill whole blocks exactly
    (7, 3, 6, 128, (0, 5)),      # one block holds all, first and last experts empty
])
def test_blocked_experts_equal_the_grouped_matmul(N, K, E, block_rows, skip):
    args = _case(N, K, E, seed=N + E, skip=skip)
    want = routed_experts(*args)
    got = jax.jit(blocked_experts, static_argnames="block_rows")(*args, block_rows=block_rows)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))

    cotangent = jnp.asarray(np.random.RandomState(7).randn(*want.shape), jnp.float32)

    def loss(fn, x, picks, weights, gate, up, down):
        return jnp.sum(fn(x, picks, weights, gate, up, down) * cotangent)
    argnums = (0, 2, 3, 4, 5)
    grads_want = jax.grad(lambda *a: loss(routed_experts, *a), argnums)(*args)
    grads_got = jax.jit(jax.grad(lambda *a: loss(lambda *b: blocked_experts(*b, block_rows=block_rows), *a),
                                 argnums))(*args)
    for g_got, g_want in zip(grads_got, grads_want, strict=True):
        np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(g_want))) + 1e-7)


def test_a_blocked_model_equals_the_ragged_model():
    cfg = C.tiny(vocab_size=80, num_hidden_layers=2, full_attention_interval=2, num_experts=8, moe_impl="ragged")
    ids = jnp.asarray(np.random.RandomState(3).randint(0, 80, (2, 24)), jnp.int32)  # 96 picks: the grouped path
    want = Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))(ids)
    got = Qwen35MoeForCausalLM(cfg.replace(moe_impl="blocked"), rngs=nnx.Rngs(0))(ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
