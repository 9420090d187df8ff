"""The SFT learner step: minimise -mean log p(action tokens) over segment-packed rows (token mean over the batch).

    loss = - sum_{b,t} mask[b,t] * log p(x[b,t] | x[b,<t], same document) / sum_{b,t} mask[b,t]

With `sft.micro_batches` M > 1 the gradient is accumulated over M micro-batches of rows (microbatch.py): each
divides by the whole batch's token count, so loss, gradient and metrics equal the whole-batch step's.
"""
from __future__ import annotations

import jax.numpy as jnp

from mercury_jax.config.defaults import setting
from mercury_jax.train.microbatch import MaskTotals
from mercury_jax.train.state import make_update_step
from models.qwen35_moe.logprobs import sequence_logprobs


def sft_loss(model, batch, totals=None):
    """(loss, metrics) of the module docstring; with `totals` (the whole batch's, micro-batches) every value is this
    micro-batch's share: divided by the whole batch's token count, `action_tokens` this micro-batch's count."""
    logp = sequence_logprobs(model, batch["tokens"], segment_ids_BxT=batch["segment_ids"])
    mask = batch["loss_mask"]
    count = jnp.maximum(jnp.sum(mask) if totals is None else totals["tokens"], 1.0)
    loss = -jnp.sum(logp * mask) / count
    return loss, {"action_tokens": jnp.sum(mask), "token_accuracy_proxy": jnp.sum(jnp.exp(logp) * mask) / count}


def make_sft_step(graphdef, tx, cfg, *, state_shardings=None):
    """jit(params, frozen, opt_state, batch) -> (params, opt_state, metrics) of `sft_loss` over a batch of packed
    rows (tokens, segment_ids, loss_mask [B, T]); `cfg` is the config's `sft` section."""
    return make_update_step(graphdef, tx, sft_loss, state_shardings=state_shardings,
                            micro_batches=setting(cfg, "micro_batches"),
                            totals_fn=MaskTotals("token-mean", mask_key="loss_mask"))
