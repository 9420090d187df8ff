"""The SAO learner step, as jitted functions over a padded trajectory batch (docs/ALGORITHMS.md, pipeline 1).

    V_t      = critic(x)[t - 1]                        value of the state that predicts token t
    lam_b    = max(0, 1 - 1 / (alpha * L_b))            length-adaptive lambda of row b (L_b action tokens)
    A        = skip_observation_gae(r, V, mask; gamma, lam_b)          policy advantages
    G        = skip_observation_gae(r, V, mask; gamma, lam_critic) + V targets (Monte-Carlo R with gamma = lam = 1)
    critic:  K epochs of 0.5 (V - G)^2, token-mean over action tokens
    actor:   DIS loss on r_t = exp(logp_t - rollout_logp_t); -sg(r) A logp inside (1 - eps_low, 1 + eps_high)
             (`policy_loss = "ppo"`: PPO's clipped surrogate instead; the group-baseline pipeline takes either)
Advantages and targets are computed once per step from the critic before its updates. The actor and critic steps
accumulate over `sao.actor_micro_batches` / `sao.critic_micro_batches` micro-batches of rows (microbatch.py), the
loss and metrics normalised by the whole batch's denominators, so they equal the whole-batch step's.

A packed batch (`sao.pack_rows`, packing.py: `segment_ids`, `unpack_index`, `pack_index`) runs every forward on the
packed rows; the advantage program moves values, rewards and the mask to the trajectories' own padded layout for
GAE and its statistics, and returns advantages, returns and values packed again.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.config.defaults import setting
from mercury_jax.parallel import with_mesh_context
from mercury_jax.rl.advantages import length_adaptive_lambda, masked_whiten, skip_observation_gae
from mercury_jax.rl.losses import dis_policy_loss, ppo_clip_loss, value_loss
from mercury_jax.train.microbatch import MaskTotals, map_rows, token_share
from mercury_jax.train.state import make_update_step
from models.qwen35_moe.logprobs import sequence_logprobs

# policy_loss -> (the loss, the metric of the fraction of action tokens it masked or clipped, that fraction's aux key)
POLICY_LOSSES = {"dis": (dis_policy_loss, "dis_masked_fraction", "masked_fraction"),
                 "ppo": (ppo_clip_loss, "clip_fraction", "clip_fraction")}


def aligned_values(critic, tokens_BxT, segment_ids_BxT=None):
    """Critic values aligned with the token they score: entry t from the hidden state at t - 1 (0 at t = 0)."""
    values_BxT = critic(tokens_BxT, segment_ids=segment_ids_BxT)
    return jnp.pad(values_BxT[:, :-1], ((0, 0), (1, 0)))


def relayout(x_BxT, index_BxT):
    """`x` moved between the packed and the padded layout by a `packing.pack_batch` index map (0 where the map
    points past the end)."""
    return jnp.take(jnp.reshape(x_BxT, (-1,)), index_BxT, mode="fill", fill_value=0)


def make_advantage_fn(critic_graphdef, cfg, *, mesh=None):
    """jit(critic params, frozen, batch) -> (advantages, returns, values, stats). The critic's forward runs over
    `cfg.critic_micro_batches` micro-batches of rows (`microbatch.map_rows`), as its update step does; GAE then
    runs on the whole batch. `mesh`: the critic's (the context for kernels that shard_map themselves)."""
    def advantages(critic_params, critic_frozen, batch):
        critic = nnx.merge(critic_graphdef, critic_params, critic_frozen)
        packed = "segment_ids" in batch
        forward = {k: batch[k] for k in ("tokens", "segment_ids", "action_mask") if k in batch}
        values = map_rows(lambda rows: aligned_values(critic, rows["tokens"], rows.get("segment_ids")), forward,
                          setting(cfg, "critic_micro_batches"), mask_key="action_mask")
        if packed:  # GAE on the trajectories as they are
            pack_index, unpack_index = batch["pack_index"], batch["unpack_index"]
            values = relayout(values, unpack_index)
            batch = {key: relayout(batch[key], unpack_index) for key in ("action_mask", "rewards")}
        mask = batch["action_mask"]
        values = values * mask
        lam = length_adaptive_lambda(mask, alpha=cfg.alpha)
        adv, _ = skip_observation_gae(batch["rewards"], values, mask, gamma=cfg.gamma, lam=lam, check=False)
        critic_adv, _ = skip_observation_gae(batch["rewards"], values, mask, gamma=cfg.gamma, lam=cfg.lam_critic,
                                             check=False)
        returns = (critic_adv + values) * mask
        if cfg.whiten_advantages:
            adv = masked_whiten(adv, mask) * mask
        residual = (returns - values) * mask
        count = jnp.maximum(jnp.sum(mask), 1.0)
        var_returns = jnp.sum(jnp.square(returns - jnp.sum(returns) / count) * mask) / count
        var_residual = jnp.sum(jnp.square(residual - jnp.sum(residual) / count) * mask) / count
        # undefined when every return is equal (e.g. a batch of zero rewards): reported as 0, not -1e4
        explained = jnp.where(var_returns > 1e-8, 1.0 - var_residual / jnp.maximum(var_returns, 1e-8), 0.0)
        stats = {"explained_variance": explained,
                 "advantage_mean": jnp.sum(adv) / count, "value_mean": jnp.sum(values) / count,
                 "lambda_mean": jnp.mean(lam)}
        if packed:
            adv, returns, values = (relayout(x, pack_index) for x in (adv, returns, values))
        return adv, returns, values, stats
    return jax.jit(with_mesh_context(advantages, mesh))


def make_critic_step(critic_graphdef, tx, cfg, *, state_shardings=None):
    """jit(params, frozen, opt_state, batch) -> (params, opt_state, metrics) of the clipped value loss; with
    `cfg.critic_micro_batches` M > 1 the gradient is accumulated over M micro-batches of rows (microbatch.py)."""
    def loss_fn(critic, batch, totals=None):
        values = aligned_values(critic, batch["tokens"], batch.get("segment_ids"))
        loss, _ = value_loss(values, batch["returns"], batch["action_mask"],
                             old_values=batch["old_values"] if cfg.value_clip else None,
                             value_clip=cfg.value_clip or None, loss_agg=cfg.loss_agg,
                             denominator=None if totals is None else totals["den"],
                             segment_ids=batch.get("segment_ids"))
        return loss, {"value_loss": loss}
    return make_update_step(critic_graphdef, tx, loss_fn, state_shardings=state_shardings,
                            micro_batches=setting(cfg, "critic_micro_batches"), totals_fn=MaskTotals(cfg.loss_agg))


def make_actor_step(actor_graphdef, tx, cfg, *, state_shardings=None):
    """jit(params, frozen, opt_state, batch) -> (params, opt_state, metrics) of the policy loss `cfg.policy_loss`:
    "dis" (SAO's: tokens outside the trust band are masked out of the gradient) or "ppo" (the clipped surrogate);
    with `cfg.actor_micro_batches` M > 1 the gradient is accumulated over M micro-batches of rows (microbatch.py).
    The batch's `advantages` are per token, whatever computed them (GAE, or a group baseline)."""
    kind = setting(cfg, "policy_loss")
    if kind not in POLICY_LOSSES:
        raise ValueError(f"policy_loss {kind!r} is not one of {sorted(POLICY_LOSSES)}")
    loss_of, fraction, fraction_aux = POLICY_LOSSES[kind]

    def loss_fn(actor, batch, totals=None):
        logp = sequence_logprobs(actor, batch["tokens"], segment_ids_BxT=batch.get("segment_ids"))
        mask = batch["action_mask"]
        loss, aux = loss_of(logp, batch["rollout_logprobs"], batch["advantages"], mask,
                            eps_low=cfg.eps_low, eps_high=cfg.eps_high, loss_agg=cfg.loss_agg,
                            denominator=None if totals is None else totals["den"],
                            segment_ids=batch.get("segment_ids"))
        gap_sum = jnp.sum(jnp.abs(logp - batch["rollout_logprobs"]) * mask)
        if totals is None:
            count = jnp.maximum(jnp.sum(mask), 1.0)
            return loss, {"policy_loss": loss, fraction: aux[fraction_aux],
                          "mean_ratio": aux["mean_ratio"], "logp_train_rollout_gap": gap_sum / count}
        tokens = jnp.maximum(totals["tokens"], 1.0)
        count = jnp.sum(mask)
        share = (aux["num_masked"] / tokens if kind == "dis" else
                 token_share(aux[fraction_aux], count, totals["tokens"]))
        return loss, {"policy_loss": loss, fraction: share,
                      "mean_ratio": token_share(aux["mean_ratio"], count, totals["tokens"]),
                      "logp_train_rollout_gap": gap_sum / tokens}
    return make_update_step(actor_graphdef, tx, loss_fn, state_shardings=state_shardings,
                            micro_batches=setting(cfg, "actor_micro_batches"), totals_fn=MaskTotals(cfg.loss_agg))

