"""attention_impl: "blockwise" (and "splash" through the Pallas interpreter) against "dense", the [T, S] reference.

Everything is fp32 on CPU with matmul precision "highest" (conftest). The online softmax sums the same terms as
the dense softmax in another order (block by block, rescaled by exp(m_old - m_new)), so results agree to a few fp32
ulps times the number of blocks: measured max |diff| <= 6e-7 on outputs and <= 3e-7 relative on gradients here.
The tolerances below (2e-6 atol on unit-scale outputs, 1e-5 relative to the largest gradient entry) leave ~4x
margin and are still 10^4 below what a wrong mask (a leaked segment, an off-by-one causal edge) or a missing
rescale produces (differences of order 0.1 to 1).
"""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.attention import Attention, self_attention
from models.qwen35_moe.blockwise_attention import blockwise_attention
from models.qwen35_moe.logprobs import token_logprobs
from models.qwen35_moe.splash_attention import splash_self_attention

ATOL = 2e-6
GRAD_RTOL = 1e-5


def _segments(B: int, T: int) -> np.ndarray:
    """Row 0: three documents (cut at 25%, 60%, 80% of T), then padding (id 0); row 1: two documents; others: one."""
    ids = np.ones((B, T), np.int32)
    a, b, c = int(T * 0.25), int(T * 0.6), int(T * 0.8)
    ids[0, :a], ids[0, a:b], ids[0, b:c], ids[0, c:] = 1, 2, 3, 0
    if B > 1:
        ids[1, :T // 2], ids[1, T // 2:] = 1, 2
    return ids


def _qkv(B, T, N, K, D, seed=0):
    rng = np.random.RandomState(seed)
    return [jnp.asarray(rng.randn(B, T, heads, D).astype(np.float32)) for heads in (N, K, K)]


def _assert_grads_close(expected, actual):
    for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)):
        scale = float(jnp.max(jnp.abs(e)))
        np.testing.assert_allclose(a, e, rtol=0, atol=GRAD_RTOL * scale)


# 5 and 16 leave a padded last block, 8 does too (37 = 4 x 8 + 5); 64 > T: one block
@pytest.mark.parametrize("block_size, with_segments", [(5, True), (16, True), (64, True), (8, False)])
def test_blockwise_matches_dense_forward_and_gradients(block_size, with_segments):
    """GQA (4 query heads on 2 KV heads), 2 rows of 37 tokens, row 0 packed with three documents and padding."""
    B, T, N, K, D = 2, 37, 4, 2, 8
    q, k, v = _qkv(B, T, N, K, D)
    segment_ids = jnp.asarray(_segments(B, T)) if with_segments else None
    cotangent = jnp.asarray(np.random.RandomState(1).randn(B, T, N, D).astype(np.float32))

    def loss(impl, q, k, v):
        if impl == "dense":
            out = self_attention(q, k, v, segment_ids, impl="dense")
        else:
            out = blockwise_attention(q, k, v, segment_ids, block_size=block_size)
        return jnp.sum(out * cotangent), out

    (_, dense), dense_grads = jax.jit(jax.value_and_grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2),
                                                         has_aux=True))(q, k, v)
    (_, blockwise), blockwise_grads = jax.jit(jax.value_and_grad(lambda *a: loss("blockwise", *a), argnums=(0, 1, 2),
                                                                 has_aux=True))(q, k, v)
    np.testing.assert_allclose(blockwise, dense, rtol=0, atol=ATOL)
    _assert_grads_close(dense_grads, blockwise_grads)


def test_blockwise_masks_match_hand_computed_attention():
    """A query sees exactly the earlier-or-same tokens of its own document: a naive loop per query and head."""
    B, T, N, K, D = 1, 37, 2, 1, 4
    q, k, v = _qkv(B, T, N, K, D, seed=3)
    ids = _segments(B, T)
    out = np.asarray(blockwise_attention(q, k, v, jnp.asarray(ids), block_size=8))
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    for t in range(T):
        keys = [s for s in range(t + 1) if ids[0, s] == ids[0, t]]
        for h in range(N):
            scores = np.array([q[0, t, h] @ k[0, s, 0] for s in keys]) / np.sqrt(D)
            weights = np.exp(scores - scores.max())
            expected = (weights / weights.sum()) @ v[0, keys, 0]
            np.testing.assert_allclose(out[0, t, h], expected, rtol=0, atol=ATOL)


def test_blockwise_never_builds_a_txt_array():
    """No intermediate of the forward+backward (at any depth of the jaxpr) holds T x T elements."""
    B, T, N, K, D = 1, 256, 4, 2, 8
    q, k, v = _qkv(B, T, N, K, D)
    ids = jnp.asarray(_segments(B, T))
    grad = jax.grad(lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, ids, block_size=32) ** 2), argnums=(0, 1, 2))
    sizes = [np.prod(var.aval.shape) for var in _all_outvars(jax.make_jaxpr(grad)(q, k, v).jaxpr)]
    assert max(sizes) < T * T, f"largest intermediate has {max(sizes)} elements (T x T = {T * T})"
    dense_grad = jax.grad(lambda q, k, v: jnp.sum(self_attention(q, k, v, ids, impl="dense") ** 2))
    assert max(np.prod(v.aval.shape) for v in _all_outvars(jax.make_jaxpr(dense_grad)(q, k, v).jaxpr)) >= T * T


def _all_outvars(jaxpr):
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_outvars(sub)


def test_attention_layer_blockwise_matches_dense_with_parameter_gradients():
    """The gated attention layer (q/k norm, partial RoPE, gate, o_proj) at its own block size (BLOCK_SIZE = 512):
    600 tokens make 2 blocks, the last one padded. Outputs, input gradients and every parameter's gradient."""
    B, T = 1, 600
    x = jnp.asarray(np.random.RandomState(4).randn(B, T, C.tiny().hidden_size).astype(np.float32))
    ids = jnp.asarray(_segments(B, T))
    positions = jnp.asarray(np.tile(np.arange(T), (B, 1)))

    def run(impl):
        layer = Attention(C.tiny(attention_impl=impl), rngs=nnx.Rngs(0))

        def loss(layer, x):
            out, _ = layer(x, positions_BxT=positions, segment_ids_BxT=ids)
            return jnp.sum(jnp.sin(out)), out

        (_, out), (param_grads, x_grad) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(layer, x)
        return out, nnx.to_pure_dict(param_grads), x_grad

    dense, blockwise = run("dense"), run("blockwise")
    np.testing.assert_allclose(blockwise[0], dense[0], rtol=0, atol=ATOL)
    _assert_grads_close(dense[1:], blockwise[1:])


def test_splash_wrapper_matches_dense_in_the_pallas_interpreter():
    """Our use of the TPU kernel (q pre-scaling, [heads, T, D] layout, GQA head mapping, segment ids, padding to a
    128 multiple), run by the Pallas interpreter on CPU: forward and gradients w.r.t. q, k, v."""
    B, T, N, K, D = 1, 37, 4, 2, 8
    q, k, v = _qkv(B, T, N, K, D, seed=5)
    ids = jnp.asarray(_segments(B, T))
    cotangent = jnp.asarray(np.random.RandomState(6).randn(B, T, N, D).astype(np.float32))

    def value_and_grads(attend):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v) * cotangent), argnums=(0, 1, 2)))(
            q, k, v)

    dense = self_attention(q, k, v, ids, impl="dense")
    splash = splash_self_attention(q, k, v, ids, block_size=128, interpret=True)
    np.testing.assert_allclose(splash, dense, rtol=0, atol=ATOL)
    _, dense_grads = value_and_grads(lambda q, k, v: self_attention(q, k, v, ids, impl="dense"))
    _, splash_grads = value_and_grads(lambda q, k, v: splash_self_attention(q, k, v, ids, block_size=128,
                                                                            interpret=True))
    _assert_grads_close(dense_grads, splash_grads)


@pytest.fixture(scope="module")
def models():
    """The tiny model twice with the same parameters (same seed; the impl does not touch initialisation), scanned
    [GDN, attention] x 1 block under full remat (blockwise's own checkpoints nest inside the layer's)."""
    cfg = C.tiny(vocab_size=80, num_hidden_layers=2, full_attention_interval=2, remat_policy="full")
    return {impl: Qwen35MoeForCausalLM(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(7))
            for impl in ("dense", "blockwise")}


@pytest.mark.slow  # two compiles of the tiny model's forward+backward: ~50 s of CPU
def test_tiny_model_logits_and_loss_gradient_agree_between_impls(models):
    """Packed rows (three documents + padding; two documents) through the scanned stack with full remat."""
    B, T = 2, 40
    tokens = jnp.asarray(np.random.RandomState(8).randint(0, 80, size=(B, T)))
    ids = jnp.asarray(_segments(B, T))
    loss_mask = (ids > 0).astype(jnp.float32)[:, 1:]

    @nnx.jit
    def logits_and_grads(model):
        def loss(model):
            hidden, _ = model.hidden_states(tokens, segment_ids=ids)
            logp = token_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:], chunk_size=16)
            return -jnp.sum(logp * loss_mask) / jnp.sum(loss_mask), model.logits(hidden)

        (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return logits, nnx.to_pure_dict(grads)

    results = {impl: logits_and_grads(model) for impl, model in models.items()}
    np.testing.assert_allclose(results["blockwise"][0], results["dense"][0], rtol=0, atol=1e-5)
    _assert_grads_close(results["dense"][1], results["blockwise"][1])


@pytest.mark.slow  # prefill, step and full-forward compiles for two models: ~30 s of CPU
def test_decode_path_is_unchanged_by_the_impl(models):
    """A blockwise model's prefill + decode steps: bit-identical to the dense model's (the cached path is the
    dense one for every impl) and equal to its own blockwise full forward (1e-5, as test_model_decode_packing)."""
    seq = np.random.RandomState(9).randint(0, 80, size=(1, 30))
    extend = nnx.jit(lambda model, ids, cache: model.extend(ids, cache))
    step_logits = {}
    for impl, model in models.items():
        logits, cache = extend(model, jnp.asarray(seq[:, :26]), model.init_cache(1, 32))
        outs = [np.asarray(logits[0])]
        for t in range(26, 30):
            logits, cache = extend(model, jnp.asarray(seq[:, t:t + 1]), cache)
            outs.append(np.asarray(logits[0]))
        step_logits[impl] = np.concatenate(outs)
    np.testing.assert_array_equal(step_logits["blockwise"], step_logits["dense"])
    full = np.asarray(nnx.jit(lambda model, ids: model(ids))(models["blockwise"], jnp.asarray(seq)))[0]
    np.testing.assert_allclose(step_logits["blockwise"], full, rtol=0, atol=1e-5)


def test_unknown_attention_impl_is_an_error_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"attention_impl 'flash' is not one of \('dense', 'blockwise', 'splash'\)"):
        C.tiny(attention_impl="flash")
    q, k, v = _qkv(1, 4, 2, 1, 4)
    with pytest.raises(ValueError, match="attention_impl 'flash' is not one of"):
        self_attention(q, k, v, None, impl="flash")
