"""Chunked log-probs against the naive full log-softmax (values and gradients), and the critic's trainable split."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable, split_critic_params
from models.qwen35_moe.logprobs import sequence_logprobs, token_logprobs


def _naive(hidden, w, targets):
    logp = jax.nn.log_softmax(jnp.einsum("bth,hv->btv", hidden, w), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return picked, entropy


@pytest.mark.parametrize("seq_len,chunk", [(37, 8), (64, 64), (50, 1024)])
def test_chunked_logprobs_equal_naive_values_and_gradients(seq_len, chunk):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (3, seq_len, 16))
    w = jax.random.normal(k2, (16, 300)) * 0.5
    targets = jax.random.randint(k3, (3, seq_len), 0, 300)
    logp, entropy = token_logprobs(hidden, w, targets, chunk_size=chunk, with_entropy=True)
    ref_logp, ref_entropy = _naive(hidden, w, targets)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5)

    weights = jax.random.normal(jax.random.key(1), (3, seq_len))
    ours = jax.grad(lambda h, w: jnp.sum(weights * token_logprobs(h, w, targets, chunk_size=chunk)), (0, 1))
    ref = jax.grad(lambda h, w: jnp.sum(weights * _naive(h, w, targets)[0]), (0, 1))
    for a, b in zip(ours(hidden, w), ref(hidden, w)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


def test_chunked_logprobs_never_build_full_logits():
    """The jaxpr of the chunked function has no [B, T, V] intermediate (only [B, chunk, V])."""
    B, T, H, V, chunk = 2, 256, 8, 1000, 32
    jaxpr = jax.make_jaxpr(lambda h, w, y: jax.grad(lambda h: jnp.sum(token_logprobs(h, w, y, chunk_size=chunk)))(h))(
        jnp.zeros((B, T, H)), jnp.zeros((H, V)), jnp.zeros((B, T), jnp.int32))
    shapes = set()

    def collect(jpr):
        for eqn in jpr.eqns:
            for var in eqn.outvars:
                shapes.add(tuple(getattr(var.aval, "shape", ())))
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else []:
                collect(sub)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    collect(getattr(inner, "jaxpr", inner))
    collect(jaxpr.jaxpr)
    assert (B, chunk, V) in shapes
    assert not any(len(s) >= 2 and s[-1] == V and np.prod(s) >= B * T * V for s in shapes)


def test_sequence_logprobs_align_with_the_token_they_score():
    model = Qwen35MoeForCausalLM(C.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(3), (2, 20), 0, 64)
    logp = sequence_logprobs(model, ids, chunk_size=8)
    full = jax.nn.log_softmax(model(ids), axis=-1)
    expected = jnp.take_along_axis(full[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(logp[:, 1:], expected, atol=1e-5)
    assert np.all(np.asarray(logp[:, 0]) == 0)


@pytest.mark.slow  # ~22 s of CPU
def test_critic_starts_from_policy_with_zero_values_and_freezes_token_mixing():
    policy = Qwen35MoeForCausalLM(C.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    critic = Qwen35MoeCritic.from_policy(policy)
    ids = jax.random.randint(jax.random.key(4), (2, 12), 0, 64)
    np.testing.assert_array_equal(critic(ids), np.zeros((2, 12)))
    np.testing.assert_array_equal(critic.model.embed[...], policy.model.embed[...])
    policy_embed = np.array(policy.model.embed[...])
    critic.model.embed[...] = critic.model.embed[...] + 1.0  # a copy, not an alias: the policy's stays as it was
    np.testing.assert_array_equal(policy.model.embed[...], policy_embed)
    np.testing.assert_array_equal(critic.model.embed[...], policy_embed + 1.0)

    _, trainable, frozen = split_critic_params(critic)
    trainable_paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    frozen_paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(frozen)}
    assert "value_head" in trainable_paths and "model.final_norm.weight" in trainable_paths
    assert "model.blocks.layers.0.moe.router" in trainable_paths
    assert "model.blocks.layers.0.input_norm.weight" in trainable_paths
    assert "model.embed" in frozen_paths
    assert all("mixer" not in p for p in trainable_paths)
    assert any("mixer.q_proj" in p for p in frozen_paths) and any("mixer.A_log" in p for p in frozen_paths)

    # one SGD step (lr 0.1) on the trainable subset of mean((V - 1)^2), from V = h . w + b with w = b = 0:
    # dL/dV = -2 / N, so grad w = -2 mean_bt(h), grad b = -2, and the backbone's gradient is exactly 0 (it reaches
    # V only through w = 0); after the step V = h . (0.2 mean_bt(h)) + 0.2 with the backbone unchanged
    graphdef = nnx.graphdef(critic)

    def loss(train):
        values = nnx.merge(graphdef, train, frozen)(ids)
        return jnp.mean((values - 1.0) ** 2)

    hidden = np.asarray(critic.model(ids)[0], np.float32)
    grads = jax.jit(jax.grad(loss))(trainable)
    # fp32 sums over 24 positions of O(1) hidden values
    np.testing.assert_allclose(grads["value_head"][...], -2 * hidden.mean(axis=(0, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["value_bias"][...], -2.0, rtol=1e-6)
    backbone_grads = [(path, g) for path, g in nnx.to_flat_state(grads) if path[0] == "model"]
    assert backbone_grads and all(not np.any(g[...]) for _, g in backbone_grads)
    updated = jax.tree.map(lambda p, g: p - 0.1 * g, trainable, grads)
    after = nnx.merge(graphdef, updated, frozen)
    np.testing.assert_allclose(after(ids), hidden @ (0.2 * hidden.mean(axis=(0, 1))) + 0.2, rtol=1e-5, atol=1e-6)
    assert critic_trainable(("value_head",), after.value_head)
