"""Token sampling for the rollout: temperature, top-k, top-p, per-token keys, and the two log-probs we record.

Per row b (per-request parameters, so requests with different settings share one decode batch):
    scaled = logits / temperature                       (temperature 0 means greedy: argmax of the raw logits)
    top-k:  keep the k largest scaled logits (k = 0: all)
    top-p:  of what is left, keep the smallest set of most likely tokens whose probability reaches p (p = 1: all)
    token ~ softmax(filtered)
Recorded per sampled token:
    logprob          = log_softmax(logits)[token]      the policy's own distribution at temperature 1, unfiltered.
                       This is `rollout_logprobs` (docs/ALGORITHMS.md): the trust-region ratio
                       exp(logp_theta - rollout_logp) compares the learner's log-softmax with it.
    sampling_logprob = log_softmax(filtered)[token]    the distribution the token was actually drawn from
                       (equal to `logprob` at temperature 1 with no filtering; 0 for greedy).
Keys: token i of request r with seed s uses fold_in(fold_in(PRNGKey(s), r), i), so a request's draws never depend on
the slot it runs in or on the other requests in the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def token_keys(seed_B: jax.Array, request_id_B: jax.Array, token_index_B: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(fold_in(PRNGKey(seed), request_id), token_index)."""
    def one(seed, request_id, token_index):
        key = jax.random.PRNGKey(seed)
        return jax.random.fold_in(jax.random.fold_in(key, request_id), token_index)

    return jax.vmap(one)(seed_B.astype(jnp.uint32), request_id_B.astype(jnp.uint32),
                         token_index_B.astype(jnp.uint32))


def filter_logits(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array
                  ) -> jax.Array:
    """Scaled logits with tokens outside the top-k / top-p set at -inf (fp32). Greedy rows are scaled by 1.

    top-k keeps every token tied with the k-th largest logit; top-p always keeps the most likely token.
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    V = logits_BxV.shape[-1]
    safe_temperature_B = jnp.where(temperature_B > 0, temperature_B, 1.0).astype(jnp.float32)
    scaled_BxV = logits_BxV / safe_temperature_B[:, None]
    needs_filter = jnp.any(((top_k_B > 0) & (top_k_B < V)) | (top_p_B < 1.0))

    def apply(scaled_BxV):
        sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)  # descending
        k_B = jnp.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
        kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None].astype(jnp.int32), axis=-1)[:, 0]
        kept_BxV = jnp.where(scaled_BxV >= kth_B[:, None], scaled_BxV, NEG_INF)
        # top-p over the top-k survivors: the sorted prefix is the same list with the cut-off tail at -inf
        sorted_kept_BxV = jnp.where(jnp.arange(V)[None, :] < k_B[:, None], sorted_BxV, NEG_INF)
        probs_BxV = jax.nn.softmax(sorted_kept_BxV, axis=-1)
        mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        # the last sorted position whose preceding mass is still below p is the smallest logit we keep
        in_nucleus_BxV = mass_before_BxV < top_p_B[:, None]
        last_B = jnp.maximum(jnp.sum(in_nucleus_BxV, axis=-1) - 1, 0)
        threshold_B = jnp.take_along_axis(sorted_kept_BxV, last_B[:, None], axis=-1)[:, 0]
        threshold_B = jnp.where(top_p_B < 1.0, threshold_B, NEG_INF)
        return jnp.where(kept_BxV >= threshold_B[:, None], kept_BxV, NEG_INF)

    return jax.lax.cond(needs_filter, apply, lambda x: x, scaled_BxV)


def sample_tokens(logits_BxV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                  top_p_B: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (token [B] int32, logprob [B], sampling_logprob [B]) as defined in the module docstring."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    filtered_BxV = filter_logits(logits_BxV, temperature_B, top_k_B, top_p_B)
    sampled_B = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys_B, filtered_BxV)
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    is_greedy_B = temperature_B <= 0
    token_B = jnp.where(is_greedy_B, greedy_B, sampled_B).astype(jnp.int32)
    logprob_B = token_logprobs(logits_BxV, token_B)
    sampling_logprob_B = jnp.where(is_greedy_B, 0.0, token_logprobs(filtered_BxV, token_B))
    return token_B, logprob_B, sampling_logprob_B


def token_logprobs(logits_BxV: jax.Array, token_B: jax.Array) -> jax.Array:
    """log_softmax(logits)[token] per row, fp32."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    picked_B = jnp.take_along_axis(logits_BxV, token_B[:, None], axis=-1)[:, 0]
    return picked_B - jax.nn.logsumexp(logits_BxV, axis=-1)
