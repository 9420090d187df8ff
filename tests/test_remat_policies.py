"""Remat policies of the decoder stack (models/qwen35_moe/decoder.py): what each keeps for the backward pass, read
from the traced program (mercury_jax/bench/remat_residuals.py), and that none changes values or gradients.

Expected residuals per token per block (tiny, fp32 compute, hidden H = 64, 4 bytes an element), exact because the
counts are of whole [B, T, H] arrays: "full" keeps only the scan carry (H elements), "save_layer_inputs" each of
the 4 layers' inputs (4 H), "save_layer_and_moe_inputs" also each MoE input (8 H). Gradients agree with the
un-rematerialised program to fp32 reassociation (tests/tolerances.py: the whole gradient and each leaf, whose GDN
A_log and dt_bias may nearly cancel, to the rounding bound of sums over the 48 tokens): a recomputed forward runs the
same operations, but XLA may fuse the recomputation differently (observed <= 0.01 of the bound, default, AVX2 and
SSE4.2 code)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_gradients_close

from mercury_jax.bench.remat_residuals import bytes_per_token_per_block
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C

H = 64


def tiny(policy: str, layers: int = 8, interval: int = 4) -> C.Qwen35MoeConfig:
    return C.tiny(vocab_size=96, num_hidden_layers=layers, full_attention_interval=interval, remat_policy=policy,
                  attention_impl="blockwise")


@pytest.mark.parametrize("policy, elements", [("full", 1), ("save_layer_inputs", 4), ("save_layer_and_moe_inputs", 8)])
def test_saved_residuals_per_token_per_block(policy, elements):
    assert bytes_per_token_per_block(tiny(policy), tokens=64) == elements * H * 4


def test_the_released_policy_keeps_far_more_than_full_remat():
    assert bytes_per_token_per_block(tiny("dots_with_no_batch_dims_saveable"), tokens=64) > 20 * H * 4


def test_a_named_policy_does_not_change_the_loss_or_its_gradient():
    """One block (a GDN and an attention layer), the policy with both names ("full" is checked against transformers
    in test_model_hf_parity)."""
    ids = jax.random.randint(jax.random.key(1), (2, 24), 0, 96)

    def loss_and_grad(cfg):
        graphdef, params = nnx.split(Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(ids) ** 2)))(params)

    plain_loss, plain_grad = loss_and_grad(tiny("none", layers=2, interval=2))
    loss, grad = loss_and_grad(tiny("save_layer_and_moe_inputs", layers=2, interval=2))
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    assert_gradients_close(jax.device_get(grad), jax.device_get(plain_grad), n_terms=ids.size)  # sums over tokens
