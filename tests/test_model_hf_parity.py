"""Our Flax Qwen3.5-MoE against Hugging Face transformers on tiny random models (fp32 logits).

Tolerance 1e-5 max abs: both sides compute in fp32 with the same operations in a different order (chunked vs
per-chunk GDN, fused vs per-expert matmuls); observed differences are ~2e-7 on logits of magnitude ~1.
"""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from hf_reference import hf_logits, hf_model, save_checkpoint

from models.qwen35_moe import config as C
from models.qwen35_moe.hf import load_hf

ATOL = 1e-5

CONFIGS = {
    "interval4": C.tiny(vocab_size=96, num_hidden_layers=4, full_attention_interval=4),
    # interval 2 with an odd layer count: 2 scanned blocks of [GDN, attention] and one unscanned GDN layer
    "interval2_tail": C.tiny(vocab_size=96, num_hidden_layers=5, full_attention_interval=2),
}


@nnx.jit
def _forward(model, ids):
    return model(ids)


@pytest.fixture(scope="module")
def references():
    return {name: hf_model(cfg, seed=i) for i, (name, cfg) in enumerate(CONFIGS.items())}


@pytest.mark.parametrize("experts", ["fused", "unfused"])
@pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
def test_logits_match_transformers_through_checkpoint_files(references, tmp_path, experts, prefix):
    reference = references["interval4"]
    path = save_checkpoint(reference, tmp_path / "ckpt", experts=experts, prefix=prefix, extra_towers=True)
    model = load_hf(path)
    ids = np.random.RandomState(1).randint(0, 96, size=(2, 100))
    ours = np.asarray(_forward(model, ids))
    np.testing.assert_allclose(ours, hf_logits(reference, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("seq_len", [100, 130])
def test_interval_two_with_unscanned_tail(references, tmp_path, seq_len):
    cfg = CONFIGS["interval2_tail"]
    assert cfg.block_layout()[1:] == (2, ("linear_attention",))
    reference = references["interval2_tail"]
    model = load_hf(save_checkpoint(reference, tmp_path / "ckpt", experts="fused", prefix="model."))
    ids = np.random.RandomState(seq_len).randint(0, 96, size=(2, seq_len))
    np.testing.assert_allclose(np.asarray(_forward(model, ids)), hf_logits(reference, ids), atol=ATOL, rtol=0)


def test_unscanned_model_equals_scanned(references, tmp_path):
    path = save_checkpoint(references["interval4"], tmp_path / "ckpt", experts="fused", prefix="model.")
    scanned, unscanned = load_hf(path), load_hf(path, scan_layers=False)
    assert unscanned.model.blocks is None and len(unscanned.model.tail) == 4
    ids = np.random.RandomState(3).randint(0, 96, size=(1, 70))
    np.testing.assert_allclose(np.asarray(_forward(scanned, ids)), np.asarray(_forward(unscanned, ids)),
                               atol=1e-6, rtol=0)


@pytest.mark.slow  # ~33 s of CPU; tests/test_remat_policies.py keeps a policy's values in the fast tier
def test_remat_policy_does_not_change_values_or_gradients(references, tmp_path):
    import jax
    import jax.numpy as jnp

    path = save_checkpoint(references["interval4"], tmp_path / "ckpt", experts="fused", prefix="model.")
    ids = jnp.asarray(np.random.RandomState(4).randint(0, 96, size=(1, 40)))

    def loss_and_grad(model):
        graphdef, params = nnx.split(model)
        loss = jax.jit(jax.value_and_grad(lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p)(ids))[..., 0])))
        return loss(params)

    plain_loss, plain_grad = loss_and_grad(load_hf(path))
    remat_loss, remat_grad = loss_and_grad(load_hf(path, remat_policy="full"))
    np.testing.assert_allclose(plain_loss, remat_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(plain_grad), jax.tree.leaves(remat_grad)):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


def test_gradients_match_transformers(references, tmp_path):
    """d(sum of target log-probs)/d(embedding) on both sides (exercises ragged_dot and GDN backward)."""
    import jax
    import jax.numpy as jnp
    import torch

    reference = references["interval4"]
    model = load_hf(save_checkpoint(reference, tmp_path / "ckpt", experts="fused", prefix="model."))
    ids = np.random.RandomState(5).randint(0, 96, size=(2, 70))

    def loss(m):
        logp = jax.nn.log_softmax(m(jnp.asarray(ids[:, :-1])))
        return jnp.sum(jnp.take_along_axis(logp, jnp.asarray(ids[:, 1:, None]), axis=-1))

    grads = nnx.grad(loss)(model)
    reference.zero_grad()
    logits = reference(torch.as_tensor(ids[:, :-1])).logits
    torch.sum(torch.gather(torch.log_softmax(logits, -1), -1, torch.as_tensor(ids[:, 1:, None]))).backward()
    ours = np.asarray(grads.model.embed[...])
    theirs = reference.model.embed_tokens.weight.grad.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-4)
    ours_router = np.asarray(grads.model.blocks.layers[0].moe.router[...])[0]
    theirs_router = reference.model.layers[0].mlp.gate.weight.grad.numpy().T
    np.testing.assert_allclose(ours_router, theirs_router, atol=1e-5, rtol=1e-4)


def test_aux_load_balancing_loss_matches_transformers(references, tmp_path):
    import torch

    reference = references["interval4"]
    model = load_hf(save_checkpoint(reference, tmp_path / "ckpt", experts="fused", prefix="model."))
    ids = np.random.RandomState(6).randint(0, 96, size=(2, 40))
    _, aux = nnx.jit(lambda m, x: m.hidden_states(x))(model, ids)
    with torch.no_grad():
        theirs = reference(torch.as_tensor(ids), output_router_logits=True).aux_loss.item()
    np.testing.assert_allclose(float(model.aux_loss(aux)), theirs, rtol=1e-5)


def test_dense_moe_impl_matches_transformers(references, tmp_path):
    """The CPU-friendly dense expert path computes the same dropless MoE as sort + ragged_dot."""
    reference = references["interval4"]
    model = load_hf(save_checkpoint(reference, tmp_path / "ckpt", experts="fused", prefix="model."), moe_impl="dense")
    ids = np.random.RandomState(7).randint(0, 96, size=(2, 45))
    np.testing.assert_allclose(np.asarray(_forward(model, ids)), hf_logits(reference, ids), atol=ATOL, rtol=0)
