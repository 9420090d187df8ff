"""Policy, value and KL losses on [B, T] per-token arrays; fp32 math, no loops over tokens, jit- and shard-friendly.

Every loss returns `(loss, aux)`: `loss` is the scalar for this batch under `loss_agg` (see `aggregation`), and
`aux["num"]`, `aux["den"]` its (numerator, denominator) pair. For exact global means under gradient accumulation
pass `denominator=` (the den of the whole step, summed over micro-batches and devices) to every micro-batch.
Log-probs are aligned with the token they score; positions outside `action_mask` are ignored (they may hold
anything, including -inf, without producing NaN values or gradients).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mercury_jax.rl.aggregation import aggregate_loss, masked_mean

# Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp: exp overflows fp32 at 88.7, and
# an inf that a max/where discards still turns its zero cotangent into 0 * inf = NaN in the backward pass.
# e^20 ~ 4.9e8 keeps even a sum over 128 x 24576 tokens finite. A token past the clamp (the two policies give it
# probabilities e^20 apart) gets zero gradient from the clamped term, so one pathological token cannot blow up a
# step; such tokens are always outside any trust region we use.
LOG_RATIO_CLAMP = 20.0
POLICY_LOSS_NAMES = ("dis", "ppo")  # `policy_loss` choices: dis_policy_loss, ppo_clip_loss

__all__ = ["LOG_RATIO_CLAMP", "dis_policy_loss", "ppo_clip_loss", "value_loss", "kl_k1", "kl_k2", "kl_k3",
           "kl_loss"]


def dis_policy_loss(logp, rollout_logp, advantages, action_mask, *, eps_low, eps_high, loss_agg="token-mean",
                    norm_length=None, denominator=None, segment_ids=None):
    """Decoupled trust region with gradient masking (DIS).

    r_t = exp(logp_t - rollout_logp_t). Inside the band 1 - eps_low < r_t < 1 + eps_high the token's loss is
    -r_t * A_t, whose gradient -A_t * r_t * grad(logp_t) is exactly that of -stop_grad(r_t) * A_t * logp_t
    (the value reported is the usual surrogate rather than the logp-scaled one). Outside the band the token
    contributes nothing, for either sign of A_t: no clipped constant, no gradient.

    Args:
      logp, rollout_logp, advantages, action_mask: [B, T]; `rollout_logp` is the behaviour policy's log-prob.
      eps_low, eps_high: band half-widths (0.2 / 0.28 default in SAO; 0.3 / 5.0 also valid).
      loss_agg, norm_length, denominator, segment_ids: see `aggregation`.
    Returns:
      (loss, aux) with aux: masked_fraction (action tokens outside the band), clip_low_fraction (r <= 1-eps_low),
      clip_high_fraction (r >= 1+eps_high), mean_ratio, num_action_tokens, num_masked, num, den.
    """
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    log_ratio_BxT = _log_ratio(logp, rollout_logp, mask_BxT)
    ratio_BxT = jnp.exp(jax.lax.stop_gradient(log_ratio_BxT))
    low_BxT = mask_BxT & (ratio_BxT <= 1.0 - eps_low)
    high_BxT = mask_BxT & (ratio_BxT >= 1.0 + eps_high)
    in_band_BxT = mask_BxT & ~low_BxT & ~high_BxT
    # exp of 0 (not of the real log-ratio) off the band, so the discarded branch has a finite derivative.
    ratio_in_band_BxT = jnp.exp(jnp.where(in_band_BxT, log_ratio_BxT, 0.0))
    per_token_BxT = jnp.where(in_band_BxT, -ratio_in_band_BxT * jnp.asarray(advantages, jnp.float32), 0.0)
    loss, num, den = aggregate_loss(per_token_BxT, mask_BxT, loss_agg, norm_length=norm_length,
                                    denominator=denominator, segment_ids=segment_ids)
    num_tokens = jnp.sum(mask_BxT.astype(jnp.float32))
    num_masked = jnp.sum((low_BxT | high_BxT).astype(jnp.float32))
    safe_tokens = jnp.maximum(num_tokens, 1.0)
    aux = {
        "masked_fraction": num_masked / safe_tokens,
        "clip_low_fraction": jnp.sum(low_BxT.astype(jnp.float32)) / safe_tokens,
        "clip_high_fraction": jnp.sum(high_BxT.astype(jnp.float32)) / safe_tokens,
        "mean_ratio": masked_mean(ratio_BxT, mask_BxT),
        "num_action_tokens": num_tokens,
        "num_masked": num_masked,
        "num": num,
        "den": den,
    }
    return loss, aux


def ppo_clip_loss(logp, rollout_logp, advantages, action_mask, *, eps_low=0.2, eps_high=None, dual_clip=None,
                  loss_agg="token-mean", norm_length=None, denominator=None, segment_ids=None):
    """PPO clipped surrogate with asymmetric clip and optional dual clip.

    per token: L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)); with `dual_clip` c > 1 and A_t < 0,
    L_t = min(L_t, -c A_t) (bounds the loss of a negative-advantage token whose ratio exploded).

    Args:
      logp, rollout_logp, advantages, action_mask: [B, T].
      eps_low, eps_high: clip range; `eps_high` defaults to `eps_low`.
      dual_clip: None or c > 1.
    Returns:
      (loss, aux) with aux: clip_fraction (the clipped term was active), clip_low_fraction, clip_high_fraction,
      dual_clip_fraction, mean_ratio, num, den.
    """
    eps_high = eps_low if eps_high is None else eps_high
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); pass None to disable it")
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    adv_BxT = jnp.where(mask_BxT, jnp.asarray(advantages, jnp.float32), 0.0)
    ratio_BxT = jnp.exp(_log_ratio(logp, rollout_logp, mask_BxT))
    unclipped_BxT = -adv_BxT * ratio_BxT
    clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
    per_token_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
    clip_active_BxT = mask_BxT & (clipped_BxT > unclipped_BxT)
    dual_active_BxT = jnp.zeros_like(mask_BxT)
    if dual_clip is not None:
        dual_bound_BxT = -dual_clip * adv_BxT
        dual_active_BxT = mask_BxT & (adv_BxT < 0) & (per_token_BxT > dual_bound_BxT)
        per_token_BxT = jnp.where(dual_active_BxT, dual_bound_BxT, per_token_BxT)
    loss, num, den = aggregate_loss(per_token_BxT, mask_BxT, loss_agg, norm_length=norm_length,
                                    denominator=denominator, segment_ids=segment_ids)
    ratio_sg_BxT = jax.lax.stop_gradient(ratio_BxT)
    aux = {
        "clip_fraction": masked_mean(clip_active_BxT, mask_BxT),
        "clip_low_fraction": masked_mean(ratio_sg_BxT < 1.0 - eps_low, mask_BxT),
        "clip_high_fraction": masked_mean(ratio_sg_BxT > 1.0 + eps_high, mask_BxT),
        "dual_clip_fraction": masked_mean(dual_active_BxT, mask_BxT),
        "mean_ratio": masked_mean(ratio_sg_BxT, mask_BxT),
        "num": num,
        "den": den,
    }
    return loss, aux


def value_loss(values, returns, action_mask, *, old_values=None, value_clip=None, loss_agg="token-mean",
               norm_length=None, denominator=None, segment_ids=None):
    """Critic loss 0.5 * (V - G)^2 on action tokens; with `value_clip` c (needs `old_values`):
    V_c = V_old + clip(V - V_old, -c, c) and the per-token loss is 0.5 * max((V - G)^2, (V_c - G)^2).

    Returns (loss, aux) with aux: clip_fraction, mean_value, mean_return, explained_variance, num, den.
    """
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    values_BxT = jnp.asarray(values, jnp.float32)
    returns_BxT = jnp.asarray(returns, jnp.float32)
    per_token_BxT = jnp.square(values_BxT - returns_BxT)
    clip_active_BxT = jnp.zeros_like(mask_BxT)
    if value_clip is not None:
        if old_values is None:
            raise ValueError("value_clip needs old_values (the critic's values at rollout/GAE time)")
        old_BxT = jnp.asarray(old_values, jnp.float32)
        clipped_values_BxT = old_BxT + jnp.clip(values_BxT - old_BxT, -value_clip, value_clip)
        clipped_BxT = jnp.square(clipped_values_BxT - returns_BxT)
        clip_active_BxT = mask_BxT & (clipped_BxT > per_token_BxT)
        per_token_BxT = jnp.maximum(per_token_BxT, clipped_BxT)
    loss, num, den = aggregate_loss(0.5 * per_token_BxT, mask_BxT, loss_agg, norm_length=norm_length,
                                    denominator=denominator, segment_ids=segment_ids)
    residual_var = _masked_var(returns_BxT - values_BxT, mask_BxT)
    aux = {
        "clip_fraction": masked_mean(clip_active_BxT, mask_BxT),
        "mean_value": masked_mean(values_BxT, mask_BxT),
        "mean_return": masked_mean(returns_BxT, mask_BxT),
        "explained_variance": 1.0 - residual_var / jnp.maximum(_masked_var(returns_BxT, mask_BxT), 1e-8),
        "num": num,
        "den": den,
    }
    return loss, aux


def kl_k1(logp, ref_logp, *, clamp=LOG_RATIO_CLAMP):
    """k1 = -d = logp - ref_logp, d = clip(ref_logp - logp, -clamp, clamp); unbiased, per token, fp32."""
    return -_kl_log_ratio(logp, ref_logp, clamp)


def kl_k2(logp, ref_logp, *, clamp=LOG_RATIO_CLAMP):
    """k2 = d^2 / 2, d = clip(ref_logp - logp, -clamp, clamp); per token, fp32, >= 0."""
    return 0.5 * jnp.square(_kl_log_ratio(logp, ref_logp, clamp))


def kl_k3(logp, ref_logp, *, clamp=LOG_RATIO_CLAMP):
    """k3 = exp(d) - d - 1 = expm1(d) - d, d = clip(ref_logp - logp, -clamp, clamp); per token, fp32, >= 0.

    Unbiased for KL(pi || ref) under samples of pi. Gradient wrt logp: 1 - exp(d), pulling logp towards
    ref_logp. Precision: exp(d) - 1 - d cancels to nothing in fp32 for small d; expm1 removes the first
    cancellation, and for |d| < 0.1 (where expm1(d) - d still loses ~4 digits, and so would its gradient
    exp(d) - 1) we use the Taylor series d^2/2 + d^3/6 + ... + d^6/720 (truncation < 1e-8 relative). The clamp
    (see LOG_RATIO_CLAMP) keeps exp finite; beyond it the gradient is 0.
    """
    d = _kl_log_ratio(logp, ref_logp, clamp)
    small = jnp.abs(d) < 0.1
    d_small = jnp.where(small, d, 0.0)
    series = jnp.square(d_small) * (1 / 2 + d_small * (1 / 6 + d_small * (1 / 24 + d_small * (1 / 120
                                                                                             + d_small / 720))))
    d_large = jnp.where(small, 1.0, d)
    return jnp.where(small, series, jnp.expm1(d_large) - d_large)


def kl_loss(logp, ref_logp, action_mask, *, estimator="k3", clamp=LOG_RATIO_CLAMP, loss_agg="token-mean",
            norm_length=None, denominator=None, segment_ids=None):
    """Aggregated KL penalty to a frozen reference, (loss, aux) with aux: mean_kl (token mean), num, den.
    Multiply by `kl_coef` and add to the policy loss (same `loss_agg` and `denominator`)."""
    estimators = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
    if estimator not in estimators:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {sorted(estimators)}")
    mask_BxT = jnp.asarray(action_mask).astype(bool)
    per_token_BxT = estimators[estimator](jnp.where(mask_BxT, logp, 0.0), jnp.where(mask_BxT, ref_logp, 0.0),
                                          clamp=clamp)
    loss, num, den = aggregate_loss(per_token_BxT, mask_BxT, loss_agg, norm_length=norm_length,
                                    denominator=denominator, segment_ids=segment_ids)
    return loss, {"mean_kl": masked_mean(jax.lax.stop_gradient(per_token_BxT), mask_BxT), "num": num, "den": den}


# --- helpers -------------------------------------------------------------------------------------------------


def _log_ratio(logp, rollout_logp, mask_BxT):
    """Clamped fp32 log(pi_theta / pi_rollout); 0 off the action mask (where log-probs may be -inf/garbage)."""
    log_ratio = jnp.asarray(logp, jnp.float32) - jnp.asarray(rollout_logp, jnp.float32)
    return jnp.clip(jnp.where(mask_BxT, log_ratio, 0.0), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _kl_log_ratio(logp, ref_logp, clamp):
    d = jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)
    return jnp.clip(d, -clamp, clamp) if clamp is not None and not math.isinf(clamp) else d


def _masked_var(x, mask):
    mean = masked_mean(x, mask)
    return masked_mean(jnp.square(jnp.asarray(x, jnp.float32) - mean), mask)
