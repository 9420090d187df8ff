"""The learner programs on rows split by position over the mesh's 'sequence' axis (`models/qwen35_moe/row_split.py`)
equal the same programs on whole rows: the SAO actor (DIS) and critic steps, the SAO advantage program (critic
forward, skip-observation GAE over each row, returns) and the pivot-GRPO step.

Reference: each program on the mesh fsdp=2 (rows whole on a chip). Split: fsdp=2 x sequence=2 and fsdp=2 x
sequence=4, parameters laid out the same, the batch's [B, T] arrays with rows over fsdp and positions over sequence
(`placement.batch_to_mesh`). The real 2-layer tiny model (one GDN, one attention layer), fp32, 8 rows of 32
positions: prompts, actions and padding of different lengths. The optimiser captures the gradient
(`capture_gradients`), so a step's opt_state output is the gradient it saw.

Tolerance (tests/tolerances.py): the same per-token terms summed in another order (attention's keys gathered over
chips, the delta rule's state entering each span composed from span maps, log-probs chunked per chip): metrics
2 x rounding(B T) and the gradient 4 x rounding(B T) of its norm (a leaf: of its norm plus its share of the
whole); the advantage program's per-token outputs rtol 1e-5.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from tolerances import METRIC_C, assert_gradients_close, rounding

from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.train.grpo_learner import make_grpo_step
from mercury_jax.train.placement import batch_to_mesh, step_shardings
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step
from mercury_jax.train.state import TrainState
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable

V, B, T = 64, 8, 32
RTOL = METRIC_C * rounding(B * T)
SAO = dict(eps_low=0.2, eps_high=0.28, value_clip=0.2, loss_agg="token-mean", alpha=0.05, gamma=1.0,
           lam_critic=1.0, whiten_advantages=True)
GRPO = dict(eps=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k3", loss_agg="seq-mean-token-mean")
MESHES = {"whole": {"fsdp": 2}, "split2": {"fsdp": 2, "sequence": 2}, "split4": {"fsdp": 2, "sequence": 4}}


def capture_gradients() -> optax.GradientTransformation:
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def _config():
    return C.tiny(vocab_size=V, num_hidden_layers=2, full_attention_interval=2, dtype="float32", gdn_chunk_size=4,
                  attention_impl="blockwise")


def _mesh(name):
    shape = MESHES[name]
    return make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), np.float32)
    for b in range(B):
        prompt = int(rng.integers(3, 12))
        actions = 0 if b == 3 else int(rng.integers(1, T - prompt + 1))
        tokens[b, :prompt + actions] = rng.integers(1, V, prompt + actions)
        mask[b, prompt:prompt + actions] = 1
    rewards = np.zeros((B, T), np.float32)
    last = np.where(mask.any(1), T - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
    rewards[np.arange(B), last] = rng.uniform(0, 1, B) * mask.any(1)
    noise = lambda scale: (rng.normal(0.0, scale, (B, T)) * mask).astype(np.float32)  # noqa: E731
    return {"tokens": tokens, "action_mask": mask, "rewards": rewards, "advantages": noise(1.0) + mask,
            "rollout_logprobs": noise(0.3) - 4.0 * mask, "ref_logprobs": noise(0.3) - 4.0 * mask,
            "old_values": noise(0.5), "returns": noise(1.0) + mask}


def _step(make_step, module, mesh, cfg, batch, trainable=nnx.Param):
    shard_params(module, mesh)
    state = TrainState.create(module, capture_gradients(), trainable)
    step = make_step(state.graphdef, state.tx, ml_collections.ConfigDict(cfg), state_shardings=step_shardings(state))
    keys = ("tokens", "action_mask", "rollout_logprobs", "advantages", "ref_logprobs", "old_values", "returns")
    args = (state.params, state.frozen, state.opt_state, batch_to_mesh({k: batch[k] for k in keys}, mesh))
    if mesh.shape["sequence"] > 1:  # the rows really are split: the zig-zag permutation is in the program
        assert "collective_permute" in step.lower(*args).as_text()
    _, grads, metrics = step(*jax.tree.map(jnp.copy, args))
    return jax.device_get(metrics), jax.device_get(grads)


def _policy(mesh):
    return Qwen35MoeForCausalLM(_config(), rngs=nnx.Rngs(0))


def _critic(mesh):
    return Qwen35MoeCritic(_config(), rngs=nnx.Rngs(0))


def _assert_same(whole, split):
    (metrics_w, grads_w), (metrics_s, grads_s) = whole, split
    assert set(metrics_w) == set(metrics_s)
    for key, value in metrics_w.items():
        np.testing.assert_allclose(float(metrics_s[key]), float(value), rtol=RTOL, atol=1e-7, err_msg=key)
    assert float(metrics_w["grad_norm"]) > 0
    assert_gradients_close(grads_s, grads_w, n_terms=B * T)


def _critic_values_nonzero(module):
    # the critic's value head starts at zero; give it weights so values, and the backbone's gradient, are not zero
    module.value_head[...] = jax.random.normal(jax.random.key(5), module.value_head[...].shape) * 0.3
    return module


@pytest.mark.slow  # ~35-45 s of CPU each; the fast tier keeps the split advantages below (and the GDN split)
@pytest.mark.parametrize("program", ["sao_actor", "sao_critic", "grpo"])
@pytest.mark.parametrize("split", ["split2", "split4"])
def test_split_rows_step_equals_the_whole_rows_step(program, split):
    batch = _batch()
    make_step, make_module, cfg, trainable = {
        "sao_actor": (make_actor_step, _policy, SAO, nnx.Param),
        "sao_critic": (make_critic_step, lambda m: _critic_values_nonzero(_critic(m)), SAO, critic_trainable),
        "grpo": (make_grpo_step, _policy, GRPO, nnx.Param)}[program]
    results = []
    for name in ("whole", split):
        mesh = _mesh(name)
        results.append(_step(make_step, make_module(mesh), mesh, cfg, batch, trainable))
    _assert_same(*results)


@pytest.mark.parametrize("split", ["split2", "split4"])
def test_split_rows_advantages_equal_the_whole_rows_advantages(split):
    batch = _batch(1)
    results = []
    for name in ("whole", split):
        mesh = _mesh(name)
        critic = _critic_values_nonzero(_critic(mesh))
        shard_params(critic, mesh)
        state = TrainState.create(critic, capture_gradients(), critic_trainable)
        fn = make_advantage_fn(state.graphdef, ml_collections.ConfigDict(SAO), mesh=mesh)
        keys = ("tokens", "action_mask", "rewards")
        results.append(jax.device_get(fn(state.params, state.frozen, batch_to_mesh({k: batch[k] for k in keys},
                                                                                     mesh))))
    (adv_w, ret_w, val_w, stats_w), (adv_s, ret_s, val_s, stats_s) = results
    assert np.abs(val_w).sum() > 0 and np.abs(adv_w).sum() > 0
    for got, want in ((adv_s, adv_w), (ret_s, ret_w), (val_s, val_w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in stats_w:
        np.testing.assert_allclose(stats_s[key], stats_w[key], rtol=1e-5, atol=1e-6, err_msg=key)
