"""The pivot-GRPO learner step as jitted functions over a padded batch of continuations
(docs/ALGORITHMS.md, pipeline 2).

Row b = one continuation (the next assistant turn) of a pivot state: prompt tokens (action_mask 0) then the
sampled turn (action_mask 1). With A_b the group advantage of its reward (`rl.advantages.group_advantages`),
broadcast over the row's action tokens, and all math in fp32:

    r_t   = exp(clip(logp_t - rollout_logp_t, -20, 20))                         (rollout_logp: the sampler's)
    pg_t  = max(-A_b r_t, -A_b clip(r_t, 1 - eps, 1 + eps_high))                 clipped surrogate
    d_t   = clip(ref_logp_t - logp_t, -20, 20)
    k3_t  = exp(d_t) - d_t - 1  (= expm1(d_t) - d_t)                             KL(pi_theta || pi_ref) estimate
    loss  = agg(pg) + kl_coef * agg(k3)                                          agg = `loss_agg` (aggregation.py)

`ref_logp` comes from the frozen reference (the starting policy in `reference_dtype`, bf16 by default), computed
once per batch by `make_reference_logprobs` outside the gradient; it is never updated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.config.defaults import setting
from mercury_jax.parallel import param_shardings, with_mesh_context
from mercury_jax.rl.losses import LOG_RATIO_CLAMP, kl_loss, ppo_clip_loss
from mercury_jax.train.microbatch import MaskTotals, map_rows, token_share
from mercury_jax.train.state import make_update_step
from models.qwen35_moe.logprobs import sequence_logprobs

# grpo_loss's metrics that are means over the batch's action tokens (micro-batches report them as token shares)
TOKEN_MEAN_METRICS = ("kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction", "mean_ratio")


@dataclasses.dataclass(frozen=True)
class GrpoLossSettings:
    """The clip band, KL weight and estimator, and aggregation of `grpo_loss` (the `grpo` config's fields)."""
    eps: float
    eps_high: float
    kl_coef: float
    kl_estimator: str = "k3"
    loss_agg: str = "seq-mean-token-mean"

    @classmethod
    def from_config(cls, cfg) -> GrpoLossSettings:
        return cls(eps=cfg.eps, eps_high=cfg.eps_high, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                   loss_agg=cfg.loss_agg)


def grpo_loss(logp, rollout_logp, ref_logp, advantages, action_mask, settings: GrpoLossSettings, *,
              denominator=None, segment_ids=None):
    """(loss, metrics) of the module docstring on [B, T] arrays; metrics hold the policy and KL terms, the KL's
    token mean, the clip fractions and the mean ratio (all scalars). `denominator` (the whole step's, for
    micro-batches) normalises both aggregated terms (aggregation.py); the token means stay this batch's.
    `segment_ids` (packed rows): each segment is one continuation for the seq-* aggregations."""
    loss_agg = settings.loss_agg
    policy_loss, pg_aux = ppo_clip_loss(logp, rollout_logp, advantages, action_mask, eps_low=settings.eps,
                                        eps_high=settings.eps_high, loss_agg=loss_agg, denominator=denominator,
                                        segment_ids=segment_ids)
    kl_term, kl_aux = kl_loss(logp, ref_logp, action_mask, estimator=settings.kl_estimator, clamp=LOG_RATIO_CLAMP,
                              loss_agg=loss_agg, denominator=denominator, segment_ids=segment_ids)
    loss = policy_loss + settings.kl_coef * kl_term
    return loss, {"policy_loss": policy_loss, "kl_loss": kl_term, "kl": kl_aux["mean_kl"],
                  "clip_fraction": pg_aux["clip_fraction"], "clip_low_fraction": pg_aux["clip_low_fraction"],
                  "clip_high_fraction": pg_aux["clip_high_fraction"], "mean_ratio": pg_aux["mean_ratio"]}


def make_grpo_step(actor_graphdef, tx, cfg, *, state_shardings=None):
    """jit(params, frozen, opt_state, batch) -> (params, opt_state, metrics); batch: tokens [B, T] int32,
    action_mask, rollout_logprobs, ref_logprobs, advantages [B, T] float32 (and segment_ids [B, T] when packed,
    `grpo.pack_rows`). Params and optimiser state are donated.

    `state_shardings` ((params, opt_state) shardings, e.g. of the arrays passed in) pins the outputs to the
    inputs' layout: otherwise the compiler may return an equivalent layout under another name (P() for
    P(None, None)), and the second step, seeing new input shardings, would compile the whole step again.

    `cfg.micro_batches` M > 1 accumulates the gradient of this one optimiser step over M micro-batches of rows
    (microbatch.py); loss and metrics are the whole batch's. (`cfg.minibatches` are separate optimiser steps.)
    """
    def loss_fn(actor, batch, totals=None):
        logp = sequence_logprobs(actor, batch["tokens"], segment_ids_BxT=batch.get("segment_ids"))
        mask = batch["action_mask"]
        loss, metrics = grpo_loss(logp, batch["rollout_logprobs"], batch["ref_logprobs"], batch["advantages"], mask,
                                  GrpoLossSettings.from_config(cfg),
                                  denominator=None if totals is None else totals["den"],
                                  segment_ids=batch.get("segment_ids"))
        gap_sum = jnp.sum(jnp.abs(logp - batch["rollout_logprobs"]) * mask)
        if totals is None:
            count = jnp.maximum(jnp.sum(mask), 1.0)
            metrics["logp_train_rollout_gap"] = gap_sum / count
            return loss, metrics
        count = jnp.sum(jnp.asarray(mask, jnp.float32))
        for key in TOKEN_MEAN_METRICS:
            metrics[key] = token_share(metrics[key], count, totals["tokens"])
        metrics["logp_train_rollout_gap"] = gap_sum / jnp.maximum(totals["tokens"], 1.0)
        return loss, metrics

    return make_update_step(actor_graphdef, tx, loss_fn, state_shardings=state_shardings,
                            micro_batches=setting(cfg, "micro_batches"), totals_fn=MaskTotals(cfg.loss_agg))


def make_reference_logprobs(reference_graphdef, *, mesh=None, micro_batches: int = 1):
    """jit(reference_state, tokens [B, T], segment_ids [B, T] or None) -> log-probs [B, T] fp32 of the frozen
    reference (never differentiated); `mesh`: the reference's (the context for kernels that shard_map themselves).
    The forward runs over `micro_batches` groups of rows one after another (`microbatch.map_rows`; the step's own
    rows per micro-batch: at 131,072-token rows the whole batch at once needs 1.9 TB of temporaries a chip), or at
    once when they do not divide B."""
    def reference_logprobs(reference_state, tokens_BxT, segment_ids_BxT=None):
        reference = nnx.merge(reference_graphdef, reference_state)
        rows = {"tokens": tokens_BxT} if segment_ids_BxT is None else {"tokens": tokens_BxT,
                                                                        "segment_ids": segment_ids_BxT}
        groups = micro_batches if tokens_BxT.shape[0] % micro_batches == 0 else 1
        logp = map_rows(lambda r: sequence_logprobs(reference, r["tokens"], segment_ids_BxT=r.get("segment_ids")),
                        rows, groups)
        return jax.lax.stop_gradient(logp).astype(jnp.float32)
    return jax.jit(with_mesh_context(reference_logprobs, mesh))


def frozen_reference(model: nnx.Module, dtype, *, mesh=None) -> tuple:
    """(graphdef, state) of a copy of `model` with every floating array cast to `dtype` (new buffers that share
    nothing with the model), laid out like the model or, with a `mesh` on the same devices, by its logical axes on
    that mesh."""
    graphdef, state = nnx.split(model)
    shardings = jax.tree.map(lambda x: x.sharding, state) if mesh is None else param_shardings(state, mesh)
    # jnp.copy first: an astype to the same dtype is no operation, and jit would hand back the actor's own buffer
    cast = jax.jit(lambda tree: jax.tree.map(
        lambda x: jnp.copy(x).astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.copy(x), tree),
        out_shardings=shardings)
    return graphdef, cast(state)


def reference_micro_batches(cfg) -> int:
    """Row groups of the reference forward: the step's micro-batches of every minibatch (`grpo.micro_batches` x
    `grpo.minibatches`), so it holds the rows one micro-batch of the step does."""
    return setting(cfg, "micro_batches") * cfg.minibatches
