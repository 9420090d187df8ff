"""Decode state of Qwen3.5-MoE: attention K/V per full-attention layer, conv window + fp32 state per GDN layer.

Layout (a pytree, so it jits and shards like parameters):
    {"positions": [B] int32 (tokens already consumed per row),
     "blocks": [per pattern position: layer cache stacked over n_blocks on axis 0],
     "tail": [layer cache per unscanned layer]}
attention: {"k", "v": [B, S, Nkv, D] compute dtype (after k_norm and RoPE)};
GDN: {"conv_q", "conv_k": [B, W-1, Hk, Dk], "conv_v": [B, W-1, Hv, Dv] (pre-conv inputs),
      "state": [B, Hv, Dk, Dv] float32}.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from models.qwen35_moe.config import FULL_ATTENTION, Qwen35MoeConfig
from models.qwen35_moe.params import LAYERS
from models.qwen35_moe.split_kv_attention import kv_cache_axes

SLOTS = "activation_batch"  # the slot dim shards like the rows of a batch: over (data, fsdp, expert)
CACHE_AXES: Mapping[str, tuple] = {  # each cache leaf's dims by logical name, by its key (before a layers axis)
    "k": (SLOTS, None, "kv_heads", "head_dim"),
    "v": (SLOTS, None, "kv_heads", "head_dim"),
    "conv_q": (SLOTS, None, "linear_key_heads", "linear_head_dim"),
    "conv_k": (SLOTS, None, "linear_key_heads", "linear_head_dim"),
    "conv_v": (SLOTS, None, "linear_value_heads", "linear_head_dim"),
    "state": (SLOTS, "linear_value_heads", "linear_head_dim", "linear_head_dim"),
}


def layer_cache(config: Qwen35MoeConfig, layer_type: str, batch_size: int, max_length: int) -> dict:
    dt = config.compute_dtype
    B = batch_size
    if layer_type == FULL_ATTENTION:
        shape = (B, max_length, config.num_key_value_heads, config.head_dim)
        return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}
    W = config.linear_conv_kernel_dim
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
    return {"conv_q": jnp.zeros((B, W - 1, Hk, Dk), dt), "conv_k": jnp.zeros((B, W - 1, Hk, Dk), dt),
            "conv_v": jnp.zeros((B, W - 1, Hv, Dv), dt), "state": jnp.zeros((B, Hv, Dk, Dv), jnp.float32)}


def init_cache(config: Qwen35MoeConfig, batch_size: int, max_length: int) -> dict:
    """An empty cache for `batch_size` rows of up to `max_length` tokens each."""
    pattern, n_blocks, tail = config.block_layout()
    stack = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (n_blocks, *a.shape)), tree)
    return {
        "positions": jnp.zeros((batch_size,), jnp.int32),
        "blocks": [stack(layer_cache(config, t, batch_size, max_length)) for t in pattern],
        "tail": [layer_cache(config, t, batch_size, max_length) for t in tail],
    }


def cache_bytes(config: Qwen35MoeConfig, batch_size: int, max_length: int) -> int:
    """Memory of a cache, without allocating one."""
    shapes = jax.eval_shape(lambda: init_cache(config, batch_size, max_length))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def _keys(path) -> list:
    return [getattr(p, "key", None) for p in path]


def slot_axis(path) -> int:
    """The slot (batch) axis of the cache leaf at `path` (from the cache's root): 1 under "blocks" (a leading
    stacked-layers axis), else 0."""
    keys = _keys(path)
    return 1 if keys and keys[0] == "blocks" else 0


def cache_logical_axes(path, leaf, mesh=None) -> tuple:
    """The logical dim names of the cache leaf at `path` (from the cache's root): by its key (`CACHE_AXES`), K/V by
    position where their heads do not divide `mesh`'s tensor axis (`kv_cache_axes`), behind a layers axis under
    "blocks"; `positions` and any other per-slot leaf by slot."""
    keys = _keys(path)
    if keys[-1:] and keys[-1] in CACHE_AXES:
        axes = CACHE_AXES[keys[-1]]
        if keys[-1] in ("k", "v"):
            axes = kv_cache_axes(leaf.shape[-2], leaf.shape[-3], mesh)
        return (LAYERS, *axes) if slot_axis(path) == 1 else axes
    return (SLOTS,) + (None,) * (leaf.ndim - 1)
