"""Every metric the SAO and pivot-GRPO learners log, on a hand-built batch, against naive float64 loops written
here from the module docstrings (not from the library's vectorised code).

The models are two-parameter-table stand-ins, so every quantity has a closed form the loops can compute:
- `BigramPolicy`: logits at t = W[tokens[t - 1]] (one-hot hidden states, lm head W [V, V]); `sequence_logprobs`
  runs on it unchanged, and d logp_t / d W[tokens[t - 1]] = onehot(tokens[t]) - softmax(W[tokens[t - 1]]).
- `TableCritic`: critic(tokens)[t] = u[tokens[t]], so the aligned value of token t is u[tokens[t - 1]].
Rollout (and reference) log-probs are the model's own log-probs shifted by chosen log-ratios, so every ratio sits
well inside or well outside its band (never within 1e-3 of an edge): the fractions are exact counts.

Tolerance: fp32 learner math against float64 loops over 7 action tokens of O(1) values: rtol 1e-5 / atol 1e-6
(observed ~1e-7); a wrong mask, sign, band or aggregation moves a metric by > 1e-2.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from mercury_jax.rl.aggregation import LOSS_AGG_MODES
from mercury_jax.train.grpo import LEARNER_KEYS
from mercury_jax.train.grpo_learner import make_grpo_step
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step

TOL = dict(rtol=1e-5, atol=1e-6)
V = 6
LR = 0.1  # plain SGD, so the updated tables are p - LR * grad as well

# B = 3 rows, T = 8: a two-turn row (observation at t = 3), a one-turn row, a row with no action token at all.
TOKENS = np.array([[1, 2, 3, 4, 5, 0, 2, 0],
                   [3, 1, 4, 1, 5, 2, 0, 0],
                   [2, 2, 0, 0, 0, 0, 0, 0]], np.int32)
MASK = np.array([[0, 1, 1, 0, 1, 1, 0, 0],
                 [0, 0, 1, 1, 1, 0, 0, 0],
                 [0, 0, 0, 0, 0, 0, 0, 0]], np.float32)
ACTIONS = list(zip(*np.nonzero(MASK)))  # (b, t) of the 7 action tokens, row-major
REWARDS = np.zeros((3, 8), np.float32)
REWARDS[0, 5], REWARDS[1, 4] = 1.0, -0.5  # the trajectory reward on each row's last action token
VALUE_TABLE = np.array([0.1, -0.2, 0.3, 0.5, -0.4, 0.25], np.float32)
POLICY_TABLE = np.random.default_rng(0).normal(0.0, 1.0, (V, V)).astype(np.float32)
# r = exp(logp - rollout_logp) per action token, in ACTIONS order: below, inside, above the band (0.2 / 0.28), ...
RATIOS = [0.5, 1.1, 1.5, 0.9, 1.0, 0.7, 1.25]  # 1.25: inside 1 + eps_high, past 1 + eps_low
ACTOR_ADVANTAGES = [0.5, -1.0, 2.0, 0.25, -0.5, 1.5, 1.0]
GROUP_ADVANTAGES = [0.75, 0.75, 0.75, 0.75, -1.25, -1.25, -1.25]  # GRPO: one advantage per row
# GRPO only: 1.4 with A < 0 (unclipped term wins), 0.6 and 0.75 with A < 0 (clipped term wins); 3 low, 2 high
GRPO_RATIOS = [0.5, 1.25, 1.5, 0.9, 0.6, 0.75, 1.4]
REF_SHIFTS = [0.3, -0.05, 1.0, -0.5, 0.02, -1.5, 0.7]  # d = ref_logp - logp; |d| < 0.1 takes k3's series branch


class BigramPolicy(nnx.Module):
    def __init__(self, table_VxV):
        self.table = nnx.Param(jnp.asarray(table_VxV, jnp.float32))

    def hidden_states(self, input_ids_BxT, *, positions=None, segment_ids=None):
        return jax.nn.one_hot(input_ids_BxT, V, dtype=jnp.float32), {}

    def lm_head_weight(self):
        return self.table[...]


class TableCritic(nnx.Module):
    def __init__(self, values_V):
        self.values = nnx.Param(jnp.asarray(values_V, jnp.float32))

    def __call__(self, input_ids_BxT, *, segment_ids=None):  # per token: no mixing to reset
        return self.values[...][input_ids_BxT]


# ------------------------------------------------------------------------------------------------ naive loops
def naive_logp(table):
    """log softmax(W[tokens[t - 1]])[tokens[t]] in float64; 0 at t = 0."""
    table = np.asarray(table, np.float64)
    logp = np.zeros(TOKENS.shape)
    for b in range(TOKENS.shape[0]):
        for t in range(1, TOKENS.shape[1]):
            z = table[TOKENS[b, t - 1]]
            logp[b, t] = z[TOKENS[b, t]] - (z.max() + math.log(sum(math.exp(x - z.max()) for x in z)))
    return logp


def aggregation_weights(mode):
    """d loss / d per_token[b, t] of each aggregation mode (aggregation.py docstring); 0 off the mask."""
    rows_with_actions = sum(MASK[b].any() for b in range(len(MASK)))
    weights = np.zeros(MASK.shape)
    for b, t in ACTIONS:
        if mode == "token-mean":
            weights[b, t] = 1.0 / len(ACTIONS)
        elif mode == "seq-mean-token-mean":
            weights[b, t] = 1.0 / (rows_with_actions * MASK[b].sum())
        else:  # seq-mean-token-sum-norm, norm_length = T
            weights[b, t] = 1.0 / (rows_with_actions * MASK.shape[1])
    return weights


def per_action(values):
    out = np.zeros(MASK.shape)
    for (b, t), value in zip(ACTIONS, values):
        out[b, t] = value
    return out


def mean_over_actions(x):
    return sum(x[b, t] for b, t in ACTIONS) / len(ACTIONS)


def naive_gae(rewards, values, gamma, lam_B):
    """GAE over each row's action tokens only (observations deleted), V after the last action = 0."""
    adv = np.zeros(MASK.shape)
    for b in range(len(MASK)):
        idx = [t for t in range(MASK.shape[1]) if MASK[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam_B[b] * next_adv
            next_value = values[b, t]
            adv[b, t] = next_adv
    return adv


def table_gradient(d_loss_d_logp, table):
    """d loss / d W of the bigram policy, from d loss / d logp_t at each action token."""
    table = np.asarray(table, np.float64)
    grad = np.zeros(table.shape)
    for b, t in ACTIONS:
        z = table[TOKENS[b, t - 1]]
        softmax = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        grad[TOKENS[b, t - 1]] += d_loss_d_logp[b, t] * (np.eye(V)[TOKENS[b, t]] - softmax)
    return grad


def split(module):
    return nnx.split(module, nnx.Param, ...)


def sgd_step(make_step, module, cfg, batch):
    graphdef, params, frozen = split(module)
    tx = optax.sgd(LR)
    step = make_step(graphdef, tx, cfg)
    new_params, _, metrics = step(params, frozen, tx.init(params), {k: jnp.asarray(v) for k, v in batch.items()})
    return jax.device_get(metrics), new_params


# ------------------------------------------------------------------------------------------------ SAO
SAO_CASES = [dict(gamma=1.0, lam_critic=1.0, whiten_advantages=False, loss_agg="token-mean"),
             dict(gamma=0.9, lam_critic=0.95, whiten_advantages=True, loss_agg="seq-mean-token-mean")]


def sao_config(case):
    return ml_collections.ConfigDict(dict(alpha=1.5, eps_low=0.2, eps_high=0.28, value_clip=0.0, **case))


def naive_sao_advantages(cfg):
    values = np.zeros(MASK.shape)
    for b, t in ACTIONS:
        values[b, t] = VALUE_TABLE[TOKENS[b, t - 1]]  # the value of the state that predicts token t
    lengths = MASK.sum(axis=1)
    lam_B = [max(0.0, 1 - 1 / (cfg.alpha * n)) if n else 0.0 for n in lengths]
    adv = naive_gae(REWARDS, values, cfg.gamma, lam_B)
    returns = naive_gae(REWARDS, values, cfg.gamma, [cfg.lam_critic] * 3) + values * MASK
    if cfg.whiten_advantages:
        mean = mean_over_actions(adv)
        var = mean_over_actions((adv - mean) ** 2)
        adv = per_action([(adv[b, t] - mean) / math.sqrt(var + 1e-8) for b, t in ACTIONS])
    ret_mean = mean_over_actions(returns)
    residual = returns - values
    res_mean = mean_over_actions(residual)
    var_returns = mean_over_actions((returns - ret_mean) ** 2)
    var_residual = mean_over_actions((residual - res_mean) ** 2)
    stats = {"explained_variance": 1 - var_residual / var_returns if var_returns > 1e-8 else 0.0,
             "advantage_mean": mean_over_actions(adv), "value_mean": mean_over_actions(values),
             "lambda_mean": float(np.mean(lam_B))}
    return adv, returns, values, stats


@pytest.mark.parametrize("case", SAO_CASES)
def test_sao_advantages_and_their_logged_statistics(case):
    cfg = sao_config(case)
    graphdef, params, frozen = split(TableCritic(VALUE_TABLE))
    batch = {"tokens": TOKENS, "action_mask": MASK, "rewards": REWARDS}
    adv, returns, values, stats = make_advantage_fn(graphdef, cfg)(params, frozen, batch)
    want_adv, want_returns, want_values, want_stats = naive_sao_advantages(cfg)
    np.testing.assert_allclose(adv, want_adv, **TOL)
    np.testing.assert_allclose(returns, want_returns, **TOL)
    np.testing.assert_allclose(values, want_values, **TOL)
    assert set(stats) == set(want_stats)
    for key, want in want_stats.items():
        np.testing.assert_allclose(float(stats[key]), want, **TOL, err_msg=key)
    assert abs(want_stats["explained_variance"]) > 0.1  # a value that a wrong variance would miss


def test_sao_explained_variance_is_zero_when_every_return_is_equal():
    cfg = sao_config(SAO_CASES[0])
    graphdef, params, frozen = split(TableCritic(np.zeros(V, np.float32)))
    batch = {"tokens": TOKENS, "action_mask": MASK, "rewards": np.zeros_like(REWARDS)}
    *_, stats = make_advantage_fn(graphdef, cfg)(params, frozen, batch)
    assert float(stats["explained_variance"]) == 0.0 and float(stats["value_mean"]) == 0.0


@pytest.mark.parametrize("case,value_clip", [(SAO_CASES[0], 0.0), (SAO_CASES[1], 0.0), (SAO_CASES[0], 0.15)])
def test_sao_critic_step_metrics_and_update(case, value_clip):
    cfg = sao_config(case)
    cfg.value_clip = value_clip
    _, returns, values, _ = naive_sao_advantages(cfg)
    # a later critic epoch sees targets and old values that differ from its values; perturb both
    returns = returns + per_action([0.3, -0.2, 0.1, 0.4, -0.6, 0.2, 0.5])
    old_values = values + per_action([0.3, -0.3, 0.05, -0.2, 0.1, 0.25, -0.1])
    batch = {"tokens": TOKENS, "action_mask": MASK, "returns": returns.astype(np.float32),
             "old_values": old_values.astype(np.float32)}
    metrics, new_params = sgd_step(make_critic_step, TableCritic(VALUE_TABLE), cfg, batch)
    weights = aggregation_weights(cfg.loss_agg)
    value_loss, grad, clipped = 0.0, np.zeros(V), 0
    for b, t in ACTIONS:
        v, g, old = values[b, t], returns[b, t], old_values[b, t]
        square, d_square = (v - g) ** 2, v - g  # 0.5 (V - G)^2 and its derivative
        if value_clip:
            v_clipped = old + min(max(v - old, -value_clip), value_clip)
            if (v_clipped - g) ** 2 > square:  # the clipped term wins; constant in V (V is past the clip)
                square, d_square, clipped = (v_clipped - g) ** 2, 0.0, clipped + 1
        value_loss += weights[b, t] * 0.5 * square
        grad[TOKENS[b, t - 1]] += weights[b, t] * d_square
    assert (0 < clipped < len(ACTIONS)) == bool(value_clip)  # both branches exercised
    assert set(metrics) == {"value_loss", "loss", "grad_norm"}
    np.testing.assert_allclose(float(metrics["value_loss"]), value_loss, **TOL)
    np.testing.assert_allclose(float(metrics["loss"]), value_loss, **TOL)
    np.testing.assert_allclose(float(metrics["grad_norm"]), np.linalg.norm(grad), **TOL)
    np.testing.assert_allclose(new_params["values"][...], VALUE_TABLE - LR * grad, **TOL)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_sao_actor_step_metrics_and_update(loss_agg):
    cfg = sao_config(dict(SAO_CASES[0], loss_agg=loss_agg))
    logp = naive_logp(POLICY_TABLE)
    ratios, advantages = per_action(RATIOS), per_action(ACTOR_ADVANTAGES)
    rollout_logp = per_action([logp[b, t] - math.log(r) for (b, t), r in zip(ACTIONS, RATIOS)])
    batch = {"tokens": TOKENS, "action_mask": MASK, "rollout_logprobs": rollout_logp.astype(np.float32),
             "advantages": advantages.astype(np.float32)}
    metrics, new_params = sgd_step(make_actor_step, BigramPolicy(POLICY_TABLE), cfg, batch)

    weights = aggregation_weights(loss_agg)
    in_band = {(b, t): 1 - cfg.eps_low < ratios[b, t] < 1 + cfg.eps_high for b, t in ACTIONS}
    policy_loss = sum(weights[b, t] * -ratios[b, t] * advantages[b, t] for b, t in ACTIONS if in_band[b, t])
    d_loss_d_logp = per_action([weights[b, t] * -ratios[b, t] * advantages[b, t] if in_band[b, t] else 0.0
                                for b, t in ACTIONS])  # d(-r A)/d logp = -r A inside the band, 0 outside
    grad = table_gradient(d_loss_d_logp, POLICY_TABLE)
    want = {"policy_loss": policy_loss, "loss": policy_loss,
            "dis_masked_fraction": sum(not in_band[a] for a in ACTIONS) / len(ACTIONS),
            "mean_ratio": np.mean(RATIOS), "logp_train_rollout_gap": np.mean(np.abs(np.log(RATIOS))),
            "grad_norm": np.linalg.norm(grad)}
    assert want["dis_masked_fraction"] == 3 / 7  # 0.5 and 0.7 below the band, 1.5 above it
    assert set(metrics) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(float(metrics[key]), value, **TOL, err_msg=key)
    np.testing.assert_allclose(new_params["table"][...], POLICY_TABLE - LR * grad, **TOL)


# ------------------------------------------------------------------------------------------------ pivot GRPO
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_grpo_step_metrics_and_update(loss_agg):
    cfg = ml_collections.ConfigDict(dict(eps=0.2, eps_high=0.28, kl_coef=0.25, kl_estimator="k3", loss_agg=loss_agg))
    logp = naive_logp(POLICY_TABLE)
    ratios, advantages, shifts = per_action(GRPO_RATIOS), per_action(GROUP_ADVANTAGES), per_action(REF_SHIFTS)
    rollout_logp = per_action([logp[b, t] - math.log(r) for (b, t), r in zip(ACTIONS, GRPO_RATIOS)])
    ref_logp = np.where(MASK > 0, logp + shifts, -7.0)  # off the mask: anything, it must not count
    batch = {"tokens": TOKENS, "action_mask": MASK, "rollout_logprobs": rollout_logp.astype(np.float32),
             "ref_logprobs": ref_logp.astype(np.float32), "advantages": advantages.astype(np.float32)}
    metrics, new_params = sgd_step(make_grpo_step, BigramPolicy(POLICY_TABLE), cfg, batch)

    weights = aggregation_weights(loss_agg)
    policy_loss = kl_loss = 0.0
    clipped = low = high = 0
    d_loss_d_logp = np.zeros(MASK.shape)
    for b, t in ACTIONS:
        r, a, d = ratios[b, t], advantages[b, t], shifts[b, t]
        unclipped, clip = -a * r, -a * min(max(r, 1 - cfg.eps), 1 + cfg.eps_high)
        policy_loss += weights[b, t] * max(unclipped, clip)
        clipped += clip > unclipped
        low, high = low + (r < 1 - cfg.eps), high + (r > 1 + cfg.eps_high)
        k3 = math.exp(d) - d - 1
        kl_loss += weights[b, t] * k3
        d_pg = -a * r if unclipped >= clip else 0.0  # the clipped term is constant in logp outside the range
        d_k3 = 1 - math.exp(d)  # d/d logp of exp(d) - d - 1 with d = ref_logp - logp
        d_loss_d_logp[b, t] = weights[b, t] * (d_pg + cfg.kl_coef * d_k3)
    assert (clipped, low, high) == (3, 3, 2)  # 1.5 (A > 0), 0.6 and 0.75 (A < 0) clipped; 0.5 and 1.4 not
    grad = table_gradient(d_loss_d_logp, POLICY_TABLE)
    want = {"loss": policy_loss + cfg.kl_coef * kl_loss, "policy_loss": policy_loss, "kl_loss": kl_loss,
            "kl": np.mean([math.exp(d) - d - 1 for d in REF_SHIFTS]), "clip_fraction": clipped / len(ACTIONS),
            "clip_low_fraction": low / len(ACTIONS), "clip_high_fraction": high / len(ACTIONS),
            "mean_ratio": np.mean(GRPO_RATIOS), "grad_norm": np.linalg.norm(grad),
            "logp_train_rollout_gap": np.mean(np.abs(np.log(GRPO_RATIOS)))}
    assert set(want) == set(LEARNER_KEYS) == set(metrics)  # every metric the trainer logs
    for key, value in want.items():
        np.testing.assert_allclose(float(metrics[key]), value, **TOL, err_msg=key)
    np.testing.assert_allclose(new_params["table"][...], POLICY_TABLE - LR * grad, **TOL)
