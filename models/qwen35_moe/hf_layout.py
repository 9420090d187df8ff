"""The correspondence between our parameters and Hugging Face tensor names, in both directions.

Our layout keeps every tensor in the shape that shards by name ([in, out] kernels split by heads; GDN q/k/v and
their conv taps separate; experts as [E, H, I] gate/up and [E, I, H] down). HF stores [out, in] linears, the fused
GDN `in_proj_qkv` / `conv1d` channels [q | k | v], and experts either fused (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`) or unfused (`experts.{e}.{gate,up,down}_proj.weight`).

Each `TensorSpec` names one of our parameters (a path inside a decoder layer, or at the top of the model), the HF
tensors it comes from, `read` (HF tensors -> ours, through a reader that can fetch row slices) and `write`
(ours -> {HF name suffix: array}).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from models.qwen35_moe.config import FULL_ATTENTION, Qwen35MoeConfig

# A reader fetches one HF tensor (name relative to a prefix), optionally a slice along axis `axis`.
Fetch = Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    path: tuple[str, ...]                      # our parameter path (inside a layer, or from the model root)
    hf_names: tuple[str, ...]                  # HF names it is built from (relative to the layer / model prefix)
    read: Callable[[Fetch], np.ndarray]        # -> our array
    write: Callable[[np.ndarray], dict] | None  # our array -> {hf name: array}; None: fused by the exporter
    hf_shapes: tuple[tuple[int, ...], ...] = ()


def _linear(hf: str, out_shape: tuple[int, ...], in_dim: int, ours_axes_in_first: bool = True):
    """HF [out, in] linear <-> ours [in, *out_shape] (in first) or [*out_shape, in]."""
    def read(fetch):
        w = fetch(hf)
        return w.T.reshape(in_dim, *out_shape) if ours_axes_in_first else w.reshape(*out_shape, in_dim)

    def write(a):
        if ours_axes_in_first:
            return {hf: np.ascontiguousarray(a.reshape(in_dim, -1).T)}
        return {hf: np.ascontiguousarray(a.reshape(-1, in_dim))}
    return read, write


def _out_linear(hf: str, in_shape: tuple[int, ...], out_dim: int):
    """HF [out, in] linear <-> ours [*in_shape, out]."""
    def read(fetch):
        return fetch(hf).T.reshape(*in_shape, out_dim)

    def write(a):
        return {hf: np.ascontiguousarray(a.reshape(-1, out_dim).T)}
    return read, write


def _identity(hf: str):
    return (lambda fetch: fetch(hf)), (lambda a: {hf: a})


def _spec(path: str, hf_names, rw, shapes) -> TensorSpec:
    names = (hf_names,) if isinstance(hf_names, str) else tuple(hf_names)
    return TensorSpec(tuple(path.split(".")), names, rw[0], rw[1], tuple(shapes))


def attention_specs(cfg: Qwen35MoeConfig) -> list[TensorSpec]:
    H, Nq, Nkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a = "self_attn."
    return [
        _spec("mixer.q_proj", a + "q_proj.weight", _linear(a + "q_proj.weight", (Nq, 2 * D), H), [(Nq * 2 * D, H)]),
        _spec("mixer.k_proj", a + "k_proj.weight", _linear(a + "k_proj.weight", (Nkv, D), H), [(Nkv * D, H)]),
        _spec("mixer.v_proj", a + "v_proj.weight", _linear(a + "v_proj.weight", (Nkv, D), H), [(Nkv * D, H)]),
        _spec("mixer.o_proj", a + "o_proj.weight", _out_linear(a + "o_proj.weight", (Nq, D), H), [(H, Nq * D)]),
        _spec("mixer.q_norm.weight", a + "q_norm.weight", _identity(a + "q_norm.weight"), [(D,)]),
        _spec("mixer.k_norm.weight", a + "k_norm.weight", _identity(a + "k_norm.weight"), [(D,)]),
    ]


def gdn_specs(cfg: Qwen35MoeConfig) -> list[TensorSpec]:
    H, W = cfg.hidden_size, cfg.linear_conv_kernel_dim
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    la = "linear_attn."
    qkv, conv = la + "in_proj_qkv.weight", la + "conv1d.weight"
    channels = 2 * Hk * Dk + Hv * Dv
    bounds = {"q": (0, Hk * Dk, Hk, Dk), "k": (Hk * Dk, 2 * Hk * Dk, Hk, Dk), "v": (2 * Hk * Dk, channels, Hv, Dv)}

    def read_proj(part):
        lo, hi, n, d = bounds[part]
        return lambda fetch: fetch(qkv, rows=(lo, hi)).T.reshape(H, n, d)

    def read_conv(part):
        lo, hi, n, d = bounds[part]
        return lambda fetch: fetch(conv, rows=(lo, hi))[:, 0, :].T.reshape(W, n, d)

    # write=None: the exporter fuses the three parts with `gdn_fused_tensors`.
    specs = []
    for part in "qkv":
        specs.append(TensorSpec(("mixer", f"{part}_proj"), (qkv,), read_proj(part), None, ((channels, H),)))
        specs.append(TensorSpec(("mixer", f"conv_{part}"), (conv,), read_conv(part), None, ((channels, 1, W),)))
    specs += [
        _spec("mixer.z_proj", la + "in_proj_z.weight", _linear(la + "in_proj_z.weight", (Hv, Dv), H), [(Hv * Dv, H)]),
        _spec("mixer.b_proj", la + "in_proj_b.weight", _linear(la + "in_proj_b.weight", (Hv,), H), [(Hv, H)]),
        _spec("mixer.a_proj", la + "in_proj_a.weight", _linear(la + "in_proj_a.weight", (Hv,), H), [(Hv, H)]),
        _spec("mixer.dt_bias", la + "dt_bias", _identity(la + "dt_bias"), [(Hv,)]),
        _spec("mixer.A_log", la + "A_log", _identity(la + "A_log"), [(Hv,)]),
        _spec("mixer.norm.weight", la + "norm.weight", _identity(la + "norm.weight"), [(Dv,)]),
        _spec("mixer.out_proj", la + "out_proj.weight", _out_linear(la + "out_proj.weight", (Hv, Dv), H),
              [(H, Hv * Dv)]),
    ]
    return specs


def gdn_fused_tensors(cfg: Qwen35MoeConfig, mixer: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our separate GDN q/k/v projections and conv taps -> HF's fused `in_proj_qkv` and `conv1d` weights."""
    H, W = cfg.hidden_size, cfg.linear_conv_kernel_dim
    proj = [mixer[f"{p}_proj"].reshape(H, -1).T for p in "qkv"]
    conv = [mixer[f"conv_{p}"].reshape(W, -1).T[:, None, :] for p in "qkv"]
    return {"linear_attn.in_proj_qkv.weight": np.ascontiguousarray(np.concatenate(proj, axis=0)),
            "linear_attn.conv1d.weight": np.ascontiguousarray(np.concatenate(conv, axis=0))}


def moe_specs(cfg: Qwen35MoeConfig, experts_layout: str) -> list[TensorSpec]:
    """MoE tensors; `experts_layout` is "fused" or "unfused" (how the checkpoint stores routed experts)."""
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    m = "mlp."
    specs = [
        _spec("moe.router", m + "gate.weight", _linear(m + "gate.weight", (E,), H), [(E, H)]),
        _spec("moe.shared_gate_proj", m + "shared_expert.gate_proj.weight",
              _linear(m + "shared_expert.gate_proj.weight", (Is,), H), [(Is, H)]),
        _spec("moe.shared_up_proj", m + "shared_expert.up_proj.weight",
              _linear(m + "shared_expert.up_proj.weight", (Is,), H), [(Is, H)]),
        _spec("moe.shared_down_proj", m + "shared_expert.down_proj.weight",
              _out_linear(m + "shared_expert.down_proj.weight", (Is,), H), [(H, Is)]),
        _spec("moe.shared_expert_gate", m + "shared_expert_gate.weight",
              _linear(m + "shared_expert_gate.weight", (1,), H), [(1, H)]),
    ]
    if experts_layout == "fused":
        gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
        specs += [
            # write=None: the exporter builds expert tensors with `experts_hf_tensors`.
            TensorSpec(("moe", "expert_gate"), (gate_up,),
                       lambda fetch: fetch(gate_up, rows=(0, I), axis=1).transpose(0, 2, 1), None, ((E, 2 * I, H),)),
            TensorSpec(("moe", "expert_up"), (gate_up,),
                       lambda fetch: fetch(gate_up, rows=(I, 2 * I), axis=1).transpose(0, 2, 1), None,
                       ((E, 2 * I, H),)),
            TensorSpec(("moe", "expert_down"), (down,), lambda fetch: fetch(down).transpose(0, 2, 1), None,
                       ((E, H, I),)),
        ]
    elif experts_layout == "unfused":
        def read_stacked(names):
            return lambda fetch: np.stack([fetch(n).T for n in names])

        for ours, proj, shape in (("expert_gate", "gate_proj", (I, H)), ("expert_up", "up_proj", (I, H)),
                                  ("expert_down", "down_proj", (H, I))):
            names = tuple(f"{m}experts.{e}.{proj}.weight" for e in range(E))
            specs.append(TensorSpec(("moe", ours), names, read_stacked(names), None, (shape,) * E))
    else:
        raise ValueError(f"experts layout {experts_layout!r} is not 'fused' or 'unfused'")
    return specs


def experts_hf_tensors(cfg: Qwen35MoeConfig, fetch: Callable[[str], np.ndarray], experts_layout: str
                       ) -> Iterator[tuple[str, np.ndarray]]:
    """Our [E, H, I] gate/up and [E, I, H] down (`fetch("expert_gate")`, ...) -> HF fused or unfused expert
    tensors, one at a time. Fused, `gate_up_proj` is filled from gate then up, so at most the fused tensor and
    one of ours are held at once."""
    if experts_layout == "fused":
        gate = fetch("expert_gate")
        num_experts, hidden, inter = gate.shape
        gate_up = np.empty((num_experts, 2 * inter, hidden), gate.dtype)
        gate_up[:, :inter] = gate.transpose(0, 2, 1)
        del gate
        gate_up[:, inter:] = fetch("expert_up").transpose(0, 2, 1)
        yield "mlp.experts.gate_up_proj", gate_up
        del gate_up
        yield "mlp.experts.down_proj", np.ascontiguousarray(fetch("expert_down").transpose(0, 2, 1))
        return
    if experts_layout != "unfused":
        raise ValueError(f"experts must be 'fused' or 'unfused', got {experts_layout!r}")
    gate, up, down = fetch("expert_gate"), fetch("expert_up"), fetch("expert_down")
    for e in range(gate.shape[0]):
        yield f"mlp.experts.{e}.gate_proj.weight", np.ascontiguousarray(gate[e].T)
        yield f"mlp.experts.{e}.up_proj.weight", np.ascontiguousarray(up[e].T)
        yield f"mlp.experts.{e}.down_proj.weight", np.ascontiguousarray(down[e].T)


def layer_specs(cfg: Qwen35MoeConfig, layer_type: str, experts_layout: str) -> list[TensorSpec]:
    norms = [
        _spec("input_norm.weight", "input_layernorm.weight", _identity("input_layernorm.weight"),
              [(cfg.hidden_size,)]),
        _spec("post_norm.weight", "post_attention_layernorm.weight", _identity("post_attention_layernorm.weight"),
              [(cfg.hidden_size,)]),
    ]
    mixer = attention_specs(cfg) if layer_type == FULL_ATTENTION else gdn_specs(cfg)
    return norms + mixer + moe_specs(cfg, experts_layout)


def top_specs(cfg: Qwen35MoeConfig) -> list[TensorSpec]:
    """Embedding and final norm (under the model prefix) and the LM head (no prefix, marked by a leading '/')."""
    H, V = cfg.hidden_size, cfg.vocab_size
    specs = [
        _spec("model.embed", "embed_tokens.weight", _identity("embed_tokens.weight"), [(V, H)]),
        _spec("model.final_norm.weight", "norm.weight", _identity("norm.weight"), [(H,)]),
    ]
    if not cfg.tie_word_embeddings:
        specs.append(_spec("lm_head", "/lm_head.weight", _linear("/lm_head.weight", (V,), H), [(V, H)]))
    return specs
