"""Gated DeltaNet token mixer of Qwen3.5 (linear attention with a gated delta-rule state).

    q, k, v = x @ Wq, x @ Wk, x @ Wv  -> causal depthwise conv (kernel 4, tap j on x[t-3+j]) -> SiLU
    beta = sigmoid(x @ Wb);   g = -exp(A_log) * softplus(x @ Wa + dt_bias)            (fp32, g <= 0)
    q, k L2-normalised over Dk (eps 1e-6), q scaled by Dk^-0.5, key heads repeat-interleaved to value heads
    o = gated_delta_rule(q, k, v, g, beta);   out = GatedRMSNorm(o, z = x @ Wz) @ W_out
The HF fused `in_proj_qkv` / conv1d channels [q | k | v] are kept as three tensors here so each can be sharded
by heads. With `segment_ids` the conv window and the state reset at every document start; with a cache the last
`kernel - 1` pre-conv inputs and the fp32 state carry over, and steps past a row's valid length change nothing.
Rows split by position over the mesh's 'sequence' axis (`row_split`) run the conv and the rule per shard, the
conv window and the state handed across chips (`gdn_split.py`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mercury_jax.parallel import constrain, per_shard
from mercury_kernels.gated_delta import gated_delta_rule
from mercury_kernels.gated_delta.interface import resolve_impl
from models.qwen35_moe.causal_conv import causal_depthwise_conv
from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.gdn_split import split_causal_conv, split_delta_rule
from models.qwen35_moe.norms import GatedRMSNorm
from models.qwen35_moe.params import cast, constant_init, make_param, normal_init
from models.qwen35_moe.row_split import RowSplit

KEY_HEADS = ("activation_batch", "activation_length", "linear_key_heads", "linear_head_dim")
VALUE_HEADS = ("activation_batch", "activation_length", "linear_value_heads", "linear_head_dim")
GATE_HEADS = ("activation_batch", "activation_length", "linear_value_heads")
STATE = ("activation_batch", "linear_value_heads", "linear_head_dim", "linear_head_dim")
SEGMENTS = ("activation_batch", "activation_length")


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: Qwen35MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        H, W = config.hidden_size, config.linear_conv_kernel_dim
        Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
        Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
        init, pdt = normal_init(config.initializer_range), config.weight_dtype
        conv_init = normal_init(W ** -0.5)
        self.q_proj = make_param(rngs, init, (H, Hk, Dk), ("embed", "linear_key_heads", "linear_head_dim"), pdt)
        self.k_proj = make_param(rngs, init, (H, Hk, Dk), ("embed", "linear_key_heads", "linear_head_dim"), pdt)
        self.v_proj = make_param(rngs, init, (H, Hv, Dv), ("embed", "linear_value_heads", "linear_head_dim"), pdt)
        self.z_proj = make_param(rngs, init, (H, Hv, Dv), ("embed", "linear_value_heads", "linear_head_dim"), pdt)
        self.b_proj = make_param(rngs, init, (H, Hv), ("embed", "linear_value_heads"), pdt)
        self.a_proj = make_param(rngs, init, (H, Hv), ("embed", "linear_value_heads"), pdt)
        self.conv_q = make_param(rngs, conv_init, (W, Hk, Dk), ("conv", "linear_key_heads", "linear_head_dim"), pdt)
        self.conv_k = make_param(rngs, conv_init, (W, Hk, Dk), ("conv", "linear_key_heads", "linear_head_dim"), pdt)
        self.conv_v = make_param(rngs, conv_init, (W, Hv, Dv), ("conv", "linear_value_heads", "linear_head_dim"), pdt)
        self.dt_bias = make_param(rngs, constant_init(1.0), (Hv,), ("linear_value_heads",), pdt)
        self.A_log = make_param(rngs, _a_log_init, (Hv,), ("linear_value_heads",), pdt)
        self.norm = GatedRMSNorm(Dv, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.out_proj = make_param(rngs, init, (Hv, Dv, H), ("linear_value_heads", "linear_head_dim", "embed"), pdt)

    def __call__(self, x_BxTxH: jax.Array, *, segment_ids_BxT: jax.Array | None = None, cache: dict | None = None,
                 valid_BxT: jax.Array | None = None, row_split: RowSplit | None = None
                 ) -> tuple[jax.Array, dict | None]:
        """With `row_split` (no cache) the rows arrive in split order over 'sequence' (`row_split.py`)."""
        cfg = self.config
        dt = x_BxTxH.dtype
        Hk, Hv, Dk = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
        q_BxTxHkxDk = constrain(jnp.einsum("bth,hnd->btnd", x_BxTxH, cast(self.q_proj, dt)), KEY_HEADS)
        k_BxTxHkxDk = constrain(jnp.einsum("bth,hnd->btnd", x_BxTxH, cast(self.k_proj, dt)), KEY_HEADS)
        v_BxTxHvxDv = constrain(jnp.einsum("bth,hnd->btnd", x_BxTxH, cast(self.v_proj, dt)), VALUE_HEADS)
        z_BxTxHvxDv = constrain(jnp.einsum("bth,hnd->btnd", x_BxTxH, cast(self.z_proj, dt)), VALUE_HEADS)
        b_BxTxHv = jnp.einsum("bth,hn->btn", x_BxTxH, cast(self.b_proj, dt))
        a_BxTxHv = jnp.einsum("bth,hn->btn", x_BxTxH, cast(self.a_proj, dt))

        (q_BxTxHkxDk, k_BxTxHkxDk, v_BxTxHvxDv), new_windows = self._conv(
            (q_BxTxHkxDk, k_BxTxHkxDk, v_BxTxHvxDv), dt, segment_ids_BxT=segment_ids_BxT, cache=cache,
            valid_BxT=valid_BxT, row_split=row_split)

        beta_BxTxHv = jax.nn.sigmoid(b_BxTxHv).astype(jnp.float32)
        g_BxTxHv = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a_BxTxHv.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if valid_BxT is not None:  # steps past a row's length must leave the state untouched
            beta_BxTxHv = jnp.where(valid_BxT[..., None], beta_BxTxHv, 0.0)
            g_BxTxHv = jnp.where(valid_BxT[..., None], g_BxTxHv, 0.0)

        q_f32, k_f32 = l2_normalize(q_BxTxHkxDk.astype(jnp.float32)), l2_normalize(k_BxTxHkxDk.astype(jnp.float32))
        q_f32 = q_f32 * (Dk ** -0.5)
        repeat = Hv // Hk
        q_BxTxHvxDk = jnp.repeat(q_f32, repeat, axis=2)
        k_BxTxHvxDk = jnp.repeat(k_f32, repeat, axis=2)

        initial_state = None if cache is None else cache["state"]
        T = x_BxTxH.shape[1]
        impl = "recurrent" if (cache is not None and T == 1) else cfg.gdn_impl
        rule_args = (q_BxTxHvxDk, k_BxTxHvxDk, v_BxTxHvxDv.astype(jnp.float32), g_BxTxHv, beta_BxTxHv, initial_state,
                     segment_ids_BxT)
        if row_split is not None and cache is None:
            o_BxTxHvxDv, final_state = split_delta_rule(
                rule_args, row_split, impl=impl, chunk_size=cfg.gdn_chunk_size, value_dims=VALUE_HEADS,
                gate_dims=GATE_HEADS, state_dims=STATE)
        else:
            o_BxTxHvxDv, final_state = _delta_rule(*rule_args, impl=impl, chunk_size=cfg.gdn_chunk_size)
        o_BxTxHvxDv = self.norm(o_BxTxHvxDv.astype(dt), z_BxTxHvxDv)
        out_BxTxH = jnp.einsum("btnd,ndh->bth", o_BxTxHvxDv, cast(self.out_proj, dt))
        new_cache = None
        if cache is not None:
            new_cache = {"conv_q": new_windows[0], "conv_k": new_windows[1], "conv_v": new_windows[2],
                         "state": final_state}
        return out_BxTxH, new_cache


    def _conv(self, qkv: tuple, dt, *, segment_ids_BxT, cache, valid_BxT, row_split) -> tuple[list, list]:
        """(SiLU of the causal depthwise conv of each of q, k, v, their new conv windows (None without a cache)):
        on rows split over 'sequence' (no cache) by `split_causal_conv`, else over the cache's windows."""
        windows = None if cache is None else (cache["conv_q"], cache["conv_k"], cache["conv_v"])
        convolved, new_windows = [], []
        for i, (pre_BxTxNxD, weight, dims) in enumerate(zip(qkv, (self.conv_q, self.conv_k, self.conv_v),
                                                            (KEY_HEADS, KEY_HEADS, VALUE_HEADS))):
            window = None if windows is None else windows[i]
            if row_split is not None and cache is None:
                out, new_window = split_causal_conv(pre_BxTxNxD, cast(weight, dt), segment_ids_BxT, row_split,
                                                    dims), None
            else:
                out, new_window = causal_depthwise_conv(pre_BxTxNxD, cast(weight, dt),
                                                        segment_ids_BxT=segment_ids_BxT, window_BxWm1xNxD=window,
                                                        valid_BxT=valid_BxT)
            convolved.append(jax.nn.silu(out))
            new_windows.append(new_window)
        return convolved, new_windows

def _delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, initial_state_BxHxKxV, segment_ids_BxT, *,
                impl: str, chunk_size: int):
    """`gated_delta_rule`; the Pallas kernel (which XLA cannot partition) runs per shard of the mesh being traced
    under, rows over the row axes and heads over 'tensor' (`per_shard`); the pure-JAX forms are left to GSPMD."""
    def rule(q, k, v, g, beta, initial_state, segment_ids):
        return gated_delta_rule(q, k, v, g, beta, initial_state_BxHxKxV=initial_state, segment_ids_BxT=segment_ids,
                                impl=impl, chunk_size=chunk_size)

    args = (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, initial_state_BxHxKxV, segment_ids_BxT)
    if resolve_impl(impl) != "pallas":
        return rule(*args)
    return per_shard(rule, args, (VALUE_HEADS, VALUE_HEADS, VALUE_HEADS, GATE_HEADS, GATE_HEADS, STATE, SEGMENTS),
                     (VALUE_HEADS, STATE))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis (the FLA / HF convention)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
