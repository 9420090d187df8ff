"""Qwen3.5-MoE text model: backbone, causal LM head, and the decode-state entry points.

    x = embed[ids];  x = decoder_stack(x);  hidden = norm_final(x);  logits = hidden @ lm_head   (no scaling)
`__call__` is the full forward (fp32 logits). `extend` runs new tokens against a decode cache (prefill is extend
on an empty cache, a decode step is extend with T = 1); rows advance by their own valid lengths.
On a mesh whose 'sequence' axis is > 1 a full forward splits each row's positions over it: the embeddings,
positions and segment ids enter in zig-zag span order and the hidden states leave in row order (`row_split.py`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.parallel import BATCH_LENGTH_EMBED, constrain
from models.qwen35_moe.cache import init_cache
from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.decoder import DecoderLayer, apply_block_stack, create_block_stack
from models.qwen35_moe.embedding import embed_tokens
from models.qwen35_moe.moe import load_balancing_loss
from models.qwen35_moe.norms import RMSNorm
from models.qwen35_moe.params import cast, make_param, normal_init
from models.qwen35_moe.row_split import from_split_order, row_split, to_split_order

ROW = ("activation_batch", "activation_length")


def segment_positions(segment_ids_BxT: jax.Array) -> jax.Array:
    """Position of each token inside its document: t - (index where its segment started)."""
    T = segment_ids_BxT.shape[1]
    t_BxT = jnp.broadcast_to(jnp.arange(T), segment_ids_BxT.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BxT[:, :1], bool),
                              segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
    start_index_BxT = jax.lax.cummax(jnp.where(starts, t_BxT, 0), axis=1)
    return t_BxT - start_index_BxT


class Qwen35MoeModel(nnx.Module):
    """The decoder backbone: embeddings, scanned decoder blocks (+ unscanned tail), final norm."""

    def __init__(self, config: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt = config.weight_dtype
        self.embed = make_param(rngs, normal_init(config.initializer_range), (config.vocab_size, config.hidden_size),
                                ("vocab", "embed"), pdt)
        pattern, n_blocks, tail = config.block_layout()
        self.blocks = create_block_stack(config, pattern, n_blocks, rngs) if n_blocks else None
        self.tail = nnx.List([DecoderLayer(config, t, rngs=rngs) for t in tail])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)

    def __call__(self, input_ids_BxT: jax.Array, *, positions_BxT: jax.Array | None = None,
                 segment_ids_BxT: jax.Array | None = None, cache: dict | None = None,
                 lengths_B: jax.Array | None = None) -> tuple[jax.Array, dict | None, dict]:
        """Returns (hidden [B, T, H] after the final norm, new cache or None, aux with MoE routing stats)."""
        cfg = self.config
        B, T = input_ids_BxT.shape
        split = None if cache is not None else row_split(T, min_span=cfg.linear_conv_kernel_dim - 1)
        ids_BxT = input_ids_BxT if split is None else to_split_order(constrain(input_ids_BxT, ROW), split)
        x_BxTxH = constrain(embed_tokens(self.embed[...], ids_BxT, cfg.compute_dtype), BATCH_LENGTH_EMBED)
        valid_BxT, cache_start_B = None, None
        if cache is not None:
            if segment_ids_BxT is not None:
                raise ValueError("segment_ids (packing) cannot be combined with a decode cache; run packed "
                                 "sequences through the full forward")
            cache_start_B = cache["positions"]
            if lengths_B is not None:
                valid_BxT = jnp.arange(T)[None, :] < lengths_B[:, None]
            if positions_BxT is None:
                positions_BxT = cache_start_B[:, None] + jnp.arange(T)[None, :]
        elif positions_BxT is None:
            positions_BxT = (segment_positions(segment_ids_BxT) if segment_ids_BxT is not None
                             else jnp.broadcast_to(jnp.arange(T), (B, T)))
        if split is not None:  # rows split over 'sequence': the layers see them in zig-zag span order
            positions_BxT = to_split_order(constrain(positions_BxT, ROW), split)
            segment_ids_BxT = None if segment_ids_BxT is None else to_split_order(constrain(segment_ids_BxT, ROW),
                                                                                  split)
        layer_kwargs = dict(positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT,
                            cache_start_B=cache_start_B, valid_BxT=valid_BxT, row_split=split)

        auxes, new_cache = [], None
        if self.blocks is not None:
            x_BxTxH, block_caches, aux = apply_block_stack(
                self.blocks, x_BxTxH, caches=None if cache is None else cache["blocks"],
                remat_policy=cfg.remat_policy, **layer_kwargs)
            auxes.append(aux)
        tail_caches = []
        for i, layer in enumerate(self.tail):
            x_BxTxH, layer_cache, aux = layer(x_BxTxH, cache=None if cache is None else cache["tail"][i],
                                              **layer_kwargs)
            tail_caches.append(layer_cache)
            auxes.append(aux)
        if cache is not None:
            advance_B = jnp.full((B,), T, jnp.int32) if lengths_B is None else lengths_B.astype(jnp.int32)
            new_cache = {"positions": cache["positions"] + advance_B,
                         "blocks": block_caches if self.blocks is not None else cache["blocks"],
                         "tail": tail_caches}
        aux = jax.tree.map(lambda *xs: sum(xs), *auxes)
        aux["num_tokens"] = jnp.asarray(B * T, jnp.float32)
        hidden_BxTxH = self.final_norm(x_BxTxH)
        if split is not None:
            hidden_BxTxH = constrain(from_split_order(hidden_BxTxH, split), BATCH_LENGTH_EMBED)
        return hidden_BxTxH, new_cache, aux


class Qwen35MoeForCausalLM(nnx.Module):
    """Backbone + LM head. `model(ids)` returns fp32 logits [B, T, V]."""

    def __init__(self, config: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen35MoeModel(config, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = make_param(rngs, normal_init(config.initializer_range),
                                      (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                                      config.weight_dtype)

    def lm_head_weight(self) -> jax.Array:
        """The output projection as [H, V] in the compute dtype (the embedding transposed when tied)."""
        dt = self.config.compute_dtype
        return cast(self.model.embed, dt).T if self.config.tie_word_embeddings else cast(self.lm_head, dt)

    def logits(self, hidden_BxTxH: jax.Array) -> jax.Array:
        return jnp.einsum("bth,hv->btv", hidden_BxTxH, self.lm_head_weight(), preferred_element_type=jnp.float32)

    def __call__(self, input_ids_BxT: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        hidden_BxTxH, _, _ = self.model(input_ids_BxT, positions_BxT=positions, segment_ids_BxT=segment_ids)
        return self.logits(hidden_BxTxH)

    def hidden_states(self, input_ids_BxT, *, positions=None, segment_ids=None) -> tuple[jax.Array, dict]:
        """(final hidden states, aux) for chunked log-probs; never builds [B, T, V] logits."""
        hidden_BxTxH, _, aux = self.model(input_ids_BxT, positions_BxT=positions, segment_ids_BxT=segment_ids)
        return hidden_BxTxH, aux

    def aux_loss(self, aux: dict) -> jax.Array:
        """Switch load-balancing loss over all layers (HF `load_balancing_loss_func`), unscaled by the coef."""
        num_rows = aux["num_tokens"] * self.config.num_hidden_layers
        return load_balancing_loss(aux["expert_counts_E"], aux["router_prob_sum_E"], num_rows,
                                   self.config.num_experts)

    def init_cache(self, batch_size: int, max_length: int) -> dict:
        return init_cache(self.config, batch_size, max_length)

    def extend(self, input_ids_BxT: jax.Array, cache: dict, lengths_B: jax.Array | None = None
               ) -> tuple[jax.Array, dict]:
        """Feed T new tokens per row (the first `lengths_B[b]` of row b are real) after what the cache holds.

        Returns (fp32 logits [B, T, V], the advanced cache). Prefill = extend on `init_cache(...)`; a decode
        step = extend with T = 1.
        """
        hidden_BxTxH, new_cache, _ = self.model(input_ids_BxT, cache=cache, lengths_B=lengths_B)
        return self.logits(hidden_BxTxH), new_cache
