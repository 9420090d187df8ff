"""Per-token log-probabilities and entropies from hidden states, in sequence chunks.

    logp[b, t] = (h[b, t] @ W)[y[b, t]] - logsumexp(h[b, t] @ W)          (fp32)
    entropy[b, t] = logsumexp(z) - sum_v softmax(z)_v z_v,   z = h[b, t] @ W
Only a [B, chunk, V] block of fp32 logits exists at a time: a `lax.scan` walks the sequence, and each chunk is
rematerialised in the backward pass (`jax.checkpoint`), so neither pass stores full-vocabulary logits for the
sequence. Gradients flow to the hidden states and to W. On a mesh that splits rows by position over 'sequence'
(`row_split.py`) each chip's part of a row is a row of its own for the scan ([B, T, H] -> [B s, T / s, H], a
reshape that keeps every chip's tokens where they are), so the chunks never cross chips.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.qwen35_moe.row_split import sequence_shards


def token_logprobs(hidden_BxTxH: jax.Array, lm_head_HxV: jax.Array, targets_BxT: jax.Array, *,
                   chunk_size: int = 1024, with_entropy: bool = False):
    """log p(targets) [B, T] fp32 (and the entropy [B, T] when `with_entropy`)."""
    shards = sequence_shards(hidden_BxTxH.shape[1])
    if shards > 1:
        B, T, H = hidden_BxTxH.shape
        out = token_logprobs(hidden_BxTxH.reshape(B * shards, T // shards, H), lm_head_HxV,
                             targets_BxT.reshape(B * shards, T // shards), chunk_size=chunk_size,
                             with_entropy=with_entropy)
        return jax.tree.map(lambda a: a.reshape(B, T), out)
    B, T, H = hidden_BxTxH.shape
    chunk = min(chunk_size, T)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    hidden = jnp.pad(hidden_BxTxH, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    hidden_NxBxCxH = hidden.reshape(B, n_chunks, chunk, H).transpose(1, 0, 2, 3)
    targets_NxBxC = targets.reshape(B, n_chunks, chunk).transpose(1, 0, 2)

    @jax.checkpoint
    def one_chunk(h_BxCxH, y_BxC):
        logits_BxCxV = jnp.einsum("bch,hv->bcv", h_BxCxH, lm_head_HxV.astype(h_BxCxH.dtype),
                                  preferred_element_type=jnp.float32)
        log_norm_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        picked_BxC = jnp.take_along_axis(logits_BxCxV, y_BxC[..., None], axis=-1)[..., 0]
        logp_BxC = picked_BxC - log_norm_BxC
        if not with_entropy:
            return logp_BxC, jnp.zeros_like(logp_BxC)
        probs_BxCxV = jnp.exp(logits_BxCxV - log_norm_BxC[..., None])
        entropy_BxC = log_norm_BxC - jnp.sum(probs_BxCxV * logits_BxCxV, axis=-1)
        return logp_BxC, entropy_BxC

    _, (logp_NxBxC, entropy_NxBxC) = jax.lax.scan(lambda c, xs: (c, one_chunk(*xs)), None,
                                                  (hidden_NxBxCxH, targets_NxBxC))
    logp_BxT = logp_NxBxC.transpose(1, 0, 2).reshape(B, n_chunks * chunk)[:, :T]
    if not with_entropy:
        return logp_BxT
    return logp_BxT, entropy_NxBxC.transpose(1, 0, 2).reshape(B, n_chunks * chunk)[:, :T]


def sequence_logprobs(model, input_ids_BxT: jax.Array, *, segment_ids_BxT=None, chunk_size: int = 1024,
                      with_entropy: bool = False):
    """log p(input_ids[t] | input_ids[<t]) aligned with the token it scores: entry t uses the hidden state at
    t - 1; entry 0 (nothing predicts it) is 0."""
    hidden_BxTxH, _ = model.hidden_states(input_ids_BxT, segment_ids=segment_ids_BxT)
    # every position scores the next token (the last one a dummy 0), so the [B, T, H] states are never cut to T - 1
    next_BxT = jnp.pad(input_ids_BxT[:, 1:], ((0, 0), (0, 1)))
    out = token_logprobs(hidden_BxTxH, model.lm_head_weight(), next_BxT, chunk_size=chunk_size,
                         with_entropy=with_entropy)
    shift = lambda a: jnp.pad(a[:, :-1], ((0, 0), (1, 0)))  # noqa: E731
    return tuple(shift(a) for a in out) if with_entropy else shift(out)
