"""Gated full attention of Qwen3.5: GQA with q/k norm, partial RoPE and a sigmoid output gate.

q_proj emits per head [query(D) | gate(D)]; query and key get the zero-centred RMSNorm over D, then RoPE on the
first `rotary_dim` dims. Query head h reads KV head h // (Nq / Nkv).
    o = softmax(q k^T * D^-0.5 + mask) v;   out = (o * sigmoid(gate)) @ o_proj
The mask is causal, and with `segment_ids` also block-diagonal (packed documents never see each other).
With a cache, new keys/values are written at each row's next positions and queries attend to the whole cache; on
a mesh whose tensor axis the KV heads do not divide, the cache is split by sequence over that axis and the softmax
is combined across chips (`split_kv_attention.py`).
Without one (full forwards), `config.attention_impl` picks how the softmax is computed: "dense" builds the
[B, K, G, T, S] scores, "blockwise" an online softmax over key blocks (`blockwise_attention.py`), "splash" the
Pallas TPU kernel (`splash_attention.py`). The cached path is always dense (its scores are [T, cache length]).
Rows split by position over the mesh's 'sequence' axis (`row_split`) gather K/V over it (`split_attention.py`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.parallel import constrain, partitioned_mesh
from models.qwen35_moe.blockwise_attention import blockwise_attention
from models.qwen35_moe.config import ATTENTION_IMPLS, Qwen35MoeConfig
from models.qwen35_moe.dense_attention import grouped_attention
from models.qwen35_moe.norms import RMSNorm
from models.qwen35_moe.params import cast, make_param, normal_init
from models.qwen35_moe.rope import apply_rope, rope_cos_sin
from models.qwen35_moe.row_split import RowSplit
from models.qwen35_moe.splash_attention import splash_self_attention
from models.qwen35_moe.split_attention import split_self_attention
from models.qwen35_moe.split_kv_attention import kv_split_axis, split_kv_cached_attention

QUERY_HEADS = ("activation_batch", "activation_length", "heads", "head_dim")
KV_HEADS = ("activation_batch", "activation_length", "kv_heads", "head_dim")
BLOCK_SIZE = 512  # query/key block of "blockwise" and "splash": [block, block] scores per head at a time


class Attention(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        H, Nq, Nkv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        init, pdt = normal_init(config.initializer_range), config.weight_dtype
        self.q_proj = make_param(rngs, init, (H, Nq, 2 * D), ("embed", "heads", "head_dim"), pdt)
        self.k_proj = make_param(rngs, init, (H, Nkv, D), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = make_param(rngs, init, (H, Nkv, D), ("embed", "kv_heads", "head_dim"), pdt)
        self.o_proj = make_param(rngs, init, (Nq, D, H), ("heads", "head_dim", "embed"), pdt)
        self.q_norm = RMSNorm(D, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.k_norm = RMSNorm(D, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)

    def __call__(self, x_BxTxH: jax.Array, *, positions_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None,
                 cache: dict | None = None, cache_start_B: jax.Array | None = None,
                 valid_BxT: jax.Array | None = None, row_split: RowSplit | None = None
                 ) -> tuple[jax.Array, dict | None]:
        cfg = self.config
        dt = x_BxTxH.dtype
        D = cfg.head_dim
        B, T, _ = x_BxTxH.shape
        q_BxTxNx2D = constrain(jnp.einsum("bth,hnd->btnd", x_BxTxH, cast(self.q_proj, dt)), QUERY_HEADS)
        query_BxTxNxD, gate_BxTxNxD = q_BxTxNx2D[..., :D], q_BxTxNx2D[..., D:]
        key_BxTxKxD = constrain(jnp.einsum("bth,hkd->btkd", x_BxTxH, cast(self.k_proj, dt)), KV_HEADS)
        value_BxTxKxD = constrain(jnp.einsum("bth,hkd->btkd", x_BxTxH, cast(self.v_proj, dt)), KV_HEADS)
        query_BxTxNxD = self.q_norm(query_BxTxNxD)
        key_BxTxKxD = self.k_norm(key_BxTxKxD)
        cos, sin = rope_cos_sin(positions_BxT, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta, dtype=dt)
        query_BxTxNxD = apply_rope(query_BxTxNxD, cos, sin)
        key_BxTxKxD = apply_rope(key_BxTxKxD, cos, sin)

        if cache is None and row_split is not None:
            out_BxTxNxD = constrain(split_self_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD, segment_ids_BxT,
                                                         row_split, impl=cfg.attention_impl, block_size=BLOCK_SIZE),
                                    QUERY_HEADS)
            new_cache = None
        elif cache is None:
            out_BxTxNxD = self_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD, segment_ids_BxT,
                                         impl=cfg.attention_impl)
            new_cache = None
        else:
            S = cache["k"].shape[-3]
            write_index_BxT = cache_start_B[:, None] + jnp.arange(T)[None, :]
            if valid_BxT is not None:
                write_index_BxT = jnp.where(valid_BxT, write_index_BxT, S)  # out of range: dropped below
            q_index_BxT = cache_start_B[:, None] + jnp.arange(T)[None, :]
            mesh = partitioned_mesh()
            if kv_split_axis(cfg.num_key_value_heads, S, mesh):
                out_BxTxNxD, new_cache = split_kv_cached_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD,
                                                                   cache, write_index_BxT, q_index_BxT, mesh)
                out_BxTxNxD = constrain(out_BxTxNxD, QUERY_HEADS)
            else:
                out_BxTxNxD, new_cache = whole_kv_cached_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD,
                                                                   cache, write_index_BxT, q_index_BxT)
        out_BxTxNxD = out_BxTxNxD * jax.nn.sigmoid(gate_BxTxNxD)
        return jnp.einsum("btnd,ndh->bth", out_BxTxNxD, cast(self.o_proj, dt)), new_cache


def whole_kv_cached_attention(query_BxTxNxD: jax.Array, key_BxTxKxD: jax.Array, value_BxTxKxD: jax.Array,
                              cache: dict, write_index_BxT: jax.Array,
                              query_index_BxT: jax.Array) -> tuple[jax.Array, dict]:
    """(output [B, T, N, D], the cache with the new K/V written at `write_index_BxT`, positions >= S dropped):
    queries at `query_index_BxT` attend to every cache position <= their own. A cache with a "layer" index holds
    the K/V of every scanned layer ([L, B, S, K, D]); this layer's are read and written in place there."""
    B, T = query_BxTxNxD.shape[:2]
    layer = cache.get("layer")
    S = cache["k"].shape[-3]
    rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    at = (rows_BxT, write_index_BxT) if layer is None else (layer, rows_BxT, write_index_BxT)
    keys = cache["k"].at[at].set(key_BxTxKxD.astype(cache["k"].dtype), mode="drop")
    values = cache["v"].at[at].set(value_BxTxKxD.astype(cache["v"].dtype), mode="drop")
    keys_BxSxKxD, values_BxSxKxD = (keys, values) if layer is None else (keys[layer], values[layer])
    visible_BxTxS = jnp.arange(S)[None, None, :] <= query_index_BxT[:, :, None]
    dt = query_BxTxNxD.dtype
    out_BxTxNxD = grouped_attention(query_BxTxNxD, keys_BxSxKxD.astype(dt), values_BxSxKxD.astype(dt), visible_BxTxS)
    return out_BxTxNxD, {"k": keys, "v": values}


def self_attention(query_BxTxNxD: jax.Array, key_BxTxKxD: jax.Array, value_BxTxKxD: jax.Array,
                   segment_ids_BxT: jax.Array | None, *, impl: str, block_size: int = BLOCK_SIZE) -> jax.Array:
    """Causal (and, with segment ids, block-diagonal) attention of a row over itself, by implementation `impl`."""
    if impl == "blockwise":
        return blockwise_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD, segment_ids_BxT,
                                   block_size=block_size)
    if impl == "splash":
        return splash_self_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD, segment_ids_BxT,
                                     block_size=block_size)
    if impl != "dense":
        raise ValueError(f"attention_impl {impl!r} is not one of {ATTENTION_IMPLS}")
    B, T = query_BxTxNxD.shape[:2]
    index_T = jnp.arange(T)
    visible_BxTxS = jnp.broadcast_to(index_T[:, None] >= index_T[None, :], (B, T, T))
    if segment_ids_BxT is not None:
        visible_BxTxS = visible_BxTxS & (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
    return grouped_attention(query_BxTxNxD, key_BxTxKxD, value_BxTxKxD, visible_BxTxS)
