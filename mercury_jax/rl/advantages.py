"""Advantage estimators: skip-observation GAE (SAO), length-adaptive lambda, group advantages (pivot GRPO).

All token-level arrays are [B, T] with `action_mask_BxT` = 1 exactly on tokens the policy sampled. Observation,
prompt and padding tokens are "masked": they consume no time step, and their outputs are 0.

Reward on a masked token (the trap that silently loses a terminal reward): `skip_observation_gae` moves a reward
found on a masked position to the nearest action token *before* it (the action whose consequence it is), so a
terminal reward put on the final `<|im_end|>`/padding token lands on the last action token. A reward that has
no action token before it (it sits in the prompt, or the row has no action tokens at all) cannot be attributed;
that is an error, raised when the inputs are concrete (checking is free there) and reported by
`unattributable_reward` for use inside `jit`. Build rewards with `place_terminal_reward` to avoid both cases.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "skip_observation_gae",
    "length_adaptive_lambda",
    "group_advantages",
    "group_stats",
    "place_terminal_reward",
    "unattributable_reward",
    "check_rewards",
    "broadcast_to_tokens",
    "masked_whiten",
]


def skip_observation_gae(rewards, values, action_mask, *, gamma, lam, bootstrap_value=None, check=True):
    """Token-level GAE over action tokens only, as one reverse `lax.scan` that carries through masked positions.

    Restricted to the action tokens a_1..a_L of a row (values V_i, rewards r_i, V_{L+1} = `bootstrap_value`,
    0 for a finished episode):
        delta_i = r_i + gamma * V_{i+1} - V_i,      A_i = delta_i + gamma * lam * A_{i+1},      G_i = A_i + V_i.
    This equals deleting the observation tokens and running ordinary GAE: the last action token before an
    observation bootstraps from the first action token after it.

    Args:
      rewards: [B, T]; a reward on a masked position is moved to the preceding action token (module docstring).
      values: [B, T] critic values aligned with the token they score; read at action positions only.
      action_mask: [B, T] bool/0-1.
      gamma: scalar or [B] discount per action step.
      lam: scalar or [B] (e.g. `length_adaptive_lambda`); lam = 1 gives Monte-Carlo targets with gamma = 1.
      bootstrap_value: optional [B] value V_{L+1} for rows cut off before the episode ended (0 = terminal).
      check: raise ValueError, when the inputs are concrete arrays this process can read, if a reward cannot be
        attributed.
    Returns:
      (advantages [B, T], returns [B, T]) float32, 0 at masked positions.
    """
    rewards_BxT = jnp.asarray(rewards, jnp.float32)
    if check and not _is_traced(rewards, action_mask):
        check_rewards(rewards, action_mask)
    batch = rewards_BxT.shape[0]
    bootstrap_B = (jnp.zeros((batch,), jnp.float32) if bootstrap_value is None
                   else jnp.broadcast_to(jnp.asarray(bootstrap_value, jnp.float32), (batch,)))
    gamma_B = jnp.broadcast_to(jnp.asarray(gamma, jnp.float32), (batch,))
    lam_B = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (batch,))
    return _gae_scan(rewards_BxT, jnp.asarray(values, jnp.float32), jnp.asarray(action_mask).astype(bool),
                     gamma_B, lam_B, bootstrap_B)


def length_adaptive_lambda(action_mask, *, alpha):
    """Per-row lambda = max(0, 1 - 1 / (alpha * L)), L = the row's action-token count; [B, T] -> [B] float32.

    A row without action tokens gets 0 (nothing to train on; avoids 1/0).
    """
    length_B = jnp.sum(jnp.asarray(action_mask).astype(jnp.float32), axis=-1)
    safe_B = jnp.where(length_B > 0, alpha * length_B, 1.0)
    return jnp.where(length_B > 0, jnp.maximum(0.0, 1.0 - 1.0 / safe_B), 0.0)


def group_advantages(rewards, *, std_normalize=True, eps=1e-6, return_stats=False):
    """GRPO advantages within each group of K samples: A = (R - mean_group) / (std_group + eps).

    `std_normalize=False` gives Dr. GRPO's A = R - mean_group. The std is the population std (ddof 0). A group whose
    rewards are all equal gets A = 0 exactly (no learning signal); `return_stats=True` also returns
    `group_stats(rewards)` to report and filter such groups.

    Args:
      rewards: [G, K] scalar rewards, G groups (states/prompts) x K samples.
    Returns:
      [G, K] float32, or ([G, K], stats dict) with `return_stats`.
    """
    rewards_GxK = jnp.asarray(rewards, jnp.float32)
    mean_G1 = jnp.mean(rewards_GxK, axis=-1, keepdims=True)
    centred_GxK = rewards_GxK - mean_G1
    if std_normalize:
        std_G1 = jnp.sqrt(jnp.mean(jnp.square(centred_GxK), axis=-1, keepdims=True))
        advantages_GxK = centred_GxK / (std_G1 + eps)
    else:
        advantages_GxK = centred_GxK
    # Exact zeros for all-equal groups, whatever rounding the mean picked up.
    advantages_GxK = jnp.where(_all_equal(rewards_GxK)[:, None], 0.0, advantages_GxK)
    if return_stats:
        return advantages_GxK, group_stats(rewards_GxK)
    return advantages_GxK


def group_stats(rewards):
    """Report on [G, K] group rewards: `zero_variance` [G] bool (all K rewards equal: zero advantage, no
    gradient), `num_zero_variance`, `zero_variance_fraction`, and `keep` [G] (the complement, for filtering)."""
    rewards_GxK = jnp.asarray(rewards, jnp.float32)
    zero_G = _all_equal(rewards_GxK)
    return {
        "zero_variance": zero_G,
        "num_zero_variance": jnp.sum(zero_G.astype(jnp.int32)),
        "zero_variance_fraction": jnp.mean(zero_G.astype(jnp.float32)),
        "keep": ~zero_G,
    }


def place_terminal_reward(reward, action_mask):
    """Put each row's scalar reward on its last action token: [B], [B, T] -> [B, T] float32.

    A row with no action tokens gets no reward (there is no token to credit); `check_rewards` flags nothing then,
    so callers that must not lose such rewards should drop those rows before this point.
    """
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    steps = mask_BxT.shape[-1]
    # Index of the last action token: the largest t with mask[t]; -1 if none.
    last_B = jnp.max(jnp.where(mask_BxT, jnp.arange(steps), -1), axis=-1)
    at_last_BxT = jnp.arange(steps)[None, :] == last_B[:, None]
    return jnp.where(at_last_BxT, jnp.asarray(reward, jnp.float32)[:, None], 0.0)


def unattributable_reward(rewards, action_mask):
    """[B] sum of |reward| on masked positions with no action token before them (GAE cannot credit it).

    Cheap and jit-able: use it as a metric or inside `checkify` when the eager check of `skip_observation_gae` is
    not available (traced inputs).
    """
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    seen_action_BxT = jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) > 0
    return jnp.sum(jnp.where(seen_action_BxT, 0.0, jnp.abs(jnp.asarray(rewards, jnp.float32))), axis=-1)


def check_rewards(rewards, action_mask, *, strict=False):
    """Raise ValueError if a reward cannot be credited to an action (concrete arrays only).

    With `strict=True` any reward on a masked position is an error, even one GAE would move to the preceding
    action token.
    """
    rewards_BxT = np.asarray(rewards, np.float32)
    mask_BxT = np.asarray(action_mask).astype(bool)
    if rewards_BxT.shape != mask_BxT.shape:
        raise ValueError(f"rewards shape {rewards_BxT.shape} != action_mask shape {mask_BxT.shape}")
    if strict:
        bad_B = np.any((rewards_BxT != 0) & ~mask_BxT, axis=-1)
        what = "a reward on a masked (non-action) token"
    else:
        bad_B = np.asarray(unattributable_reward(rewards_BxT, mask_BxT)) > 0
        what = "a reward before the row's first action token (or in a row with no action tokens)"
    if bad_B.any():
        rows = np.flatnonzero(bad_B)[:8].tolist()
        raise ValueError(f"rows {rows} have {what}; it would be lost. Put the reward on the last action "
                         "token (mercury_jax.rl.advantages.place_terminal_reward) or drop those rows.")


def broadcast_to_tokens(sequence_values, action_mask):
    """Broadcast one value per sequence over its action tokens: [B], [B, T] -> [B, T] (0 on masked tokens)."""
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    return jnp.where(mask_BxT, jnp.asarray(sequence_values, jnp.float32)[:, None], 0.0)


def masked_whiten(values, mask, *, shift_mean=True, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over the masked-in entries of `values` (any shape); 0 elsewhere.

    With `shift_mean=False` the mean is added back (scale only). Off by default in SAO (`whiten_advantages`).
    """
    values = jnp.asarray(values, jnp.float32)
    mask = jnp.asarray(mask).astype(bool)
    count = jnp.maximum(jnp.sum(mask), 1)
    mean = jnp.sum(jnp.where(mask, values, 0.0)) / count
    var = jnp.sum(jnp.where(mask, jnp.square(values - mean), 0.0)) / count
    whitened = (values - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask, whitened, 0.0)


# --- helpers -------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="unroll")
def _gae_scan(rewards_BxT, values_BxT, mask_BxT, gamma_B, lam_B, bootstrap_B, unroll=8):
    """Reverse scan over time; carry = (value of the next action token, its advantage, pending reward).
    `unroll` trades compile time for fewer loop iterations (see `python -m mercury_jax.bench.gae`)."""

    def step(carry, inputs):
        next_value_B, next_adv_B, pending_B = carry
        reward_B, value_B, is_action_B = inputs
        reward_B = reward_B + pending_B  # rewards seen on masked tokens after this one (in time)
        delta_B = reward_B + gamma_B * next_value_B - value_B
        adv_B = delta_B + gamma_B * lam_B * next_adv_B
        carry = (jnp.where(is_action_B, value_B, next_value_B),
                 jnp.where(is_action_B, adv_B, next_adv_B),
                 jnp.where(is_action_B, 0.0, reward_B))
        return carry, jnp.where(is_action_B, adv_B, 0.0)

    batch = rewards_BxT.shape[0]
    init = (bootstrap_B, jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.float32))
    _, adv_TxB = jax.lax.scan(step, init, (rewards_BxT.T, values_BxT.T, mask_BxT.T), reverse=True, unroll=unroll)
    adv_BxT = adv_TxB.T
    returns_BxT = jnp.where(mask_BxT, adv_BxT + values_BxT, 0.0)
    return adv_BxT, returns_BxT


def _all_equal(rewards_GxK):
    return jnp.all(rewards_GxK == rewards_GxK[:, :1], axis=-1)


def _is_traced(*arrays):
    """True if any input is a tracer, or a multi-host array this process cannot read (no cheap check then)."""
    return any(isinstance(a, jax.core.Tracer) or not getattr(a, "is_fully_addressable", True) for a in arrays)
