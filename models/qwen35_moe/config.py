"""Qwen3.5-MoE text configuration with Hugging Face field names, presets, and HF config conversion.

`Qwen35MoeConfig.from_hf` accepts the released composite `config.json` (`Qwen3_5MoeForConditionalGeneration`,
text model under `text_config`) and a flat text config (`Qwen3_5MoeForCausalLM`); `to_hf` writes the composite
text-only form. RoPE facts are read from `rope_parameters` (HF defaults would silently give theta 1e4).
Fields after `# runtime` are ours (compute dtype, remat, kernel choice) and never reach an HF file.

Every field's type and range (`FIELD_RANGES`) is checked before anything is derived from it, so a hostile
`config.json` (a negative width, zero heads, a billion experts) is refused by name (`BadConfigValue` from
`from_hf`, `ValueError` otherwise) instead of failing inside a shape computation or a name list.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp

from mercury_kernels.gated_delta.interface import IMPLS as GATED_DELTA_IMPLS
from models.qwen35_moe.checkpoint_errors import BadConfigValue

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
REMAT_POLICIES = ("none", "full", "save_layer_inputs", "save_layer_and_moe_inputs", "dots_saveable",
                  "dots_with_no_batch_dims_saveable")
GDN_IMPLS = GATED_DELTA_IMPLS  # the kernel registry: "auto", "chunked", "pallas", "recurrent"
MOE_IMPLS = ("ragged", "dense", "ep", "blocked")
# "dense": [T, S] scores; "blockwise": online softmax over key blocks (pure JAX); "splash": the Pallas TPU kernel
ATTENTION_IMPLS = ("dense", "blockwise", "splash")
_HF_IGNORED_KEYS = {"attn_output_gate", "mamba_ssm_dtype", "output_gate_type", "use_cache", "dtype", "torch_dtype",
                    "transformers_version", "architectures", "model_type", "layer_types", "rope_parameters",
                    "rope_scaling", "full_attention_interval", "rope_theta", "partial_rotary_factor",
                    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "attention_dropout",
                    "hidden_act", "attention_bias"}


# Sanity bounds far above any released model (the 397B: 60 layers, 512 experts): a config past them is hostile or
# broken, and the loader would otherwise build a layer list / an expert-name list of that length before any check.
MAX_LAYERS = 4096
MAX_EXPERTS = 65536


class FieldRange(NamedTuple):
    """A field's type and range: `kind` int (bool is not an int here), float (ints accepted; finite) or bool;
    `low` / `high` bounds (None: unbounded), excluded when `low_open` / `high_open`."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if self.kind is int else numbers.Real):
            return False
        if self.kind is float and not isinstance(value, numbers.Integral) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def describe(self) -> str:
        if self.kind is bool:
            return "true or false"
        noun = "a whole number" if self.kind is int else "a number"
        if self.high is None:
            return f"{noun} {'>' if self.low_open else '>='} {self.low}" if self.low is not None else noun
        return f"{noun} in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"


COUNT = FieldRange(int, 1)
FIELD_RANGES: dict[str, FieldRange] = {
    "vocab_size": COUNT, "hidden_size": COUNT, "num_hidden_layers": FieldRange(int, 1, MAX_LAYERS),
    "num_attention_heads": COUNT, "num_key_value_heads": COUNT, "head_dim": COUNT, "max_position_embeddings": COUNT,
    "rms_norm_eps": FieldRange(float, 0, low_open=True), "tie_word_embeddings": FieldRange(bool),
    "rope_theta": FieldRange(float, 0, low_open=True), "partial_rotary_factor": FieldRange(float, 0, 1, low_open=True),
    "mrope_interleaved": FieldRange(bool), "linear_conv_kernel_dim": COUNT, "linear_key_head_dim": COUNT,
    "linear_value_head_dim": COUNT, "linear_num_key_heads": COUNT, "linear_num_value_heads": COUNT,
    "moe_intermediate_size": COUNT, "shared_expert_intermediate_size": COUNT,
    "num_experts": FieldRange(int, 1, MAX_EXPERTS), "num_experts_per_tok": FieldRange(int, 1, MAX_EXPERTS),
    "router_aux_loss_coef": FieldRange(float, 0), "output_router_logits": FieldRange(bool),
    "initializer_range": FieldRange(float, 0, low_open=True), "scan_layers": FieldRange(bool),
    "gdn_chunk_size": COUNT, "moe_ep_round_factor": FieldRange(float, 0, low_open=True),
    "full_attention_interval": FieldRange(int, 1, MAX_LAYERS),  # HF's, when layer_types is absent
}
FIELD_HINTS = {"moe_ep_round_factor": "rows a dispatch round receives, in units of the balanced load; 2.0 is the "
                                      "default, 1.0 halves the buffers and takes two rounds on a skewed step"}
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def field_problems(values: Mapping[str, Any]) -> list[str]:
    """One message per field of `values` whose type or range is wrong (`FIELD_RANGES`, token ids, mrope_section,
    layer_types), naming the field, the value and what is expected. Fields `values` lacks are not checked."""
    problems = [f"{name} is {_short(values[name])}; expected {rule.describe()}"
                + (f" ({FIELD_HINTS[name]})" if name in FIELD_HINTS else "")
                for name, rule in FIELD_RANGES.items() if name in values and not rule.admits(values[name])]
    for name in TOKEN_ID_FIELDS:
        value = values.get(name)
        many = name == "eos_token_id" and isinstance(value, list | tuple)
        if value is not None and not all(_is_int(i) and i >= 0 for i in (value if many else [value])):
            problems.append(f"{name} is {_short(value)}; expected a token id (a whole number >= 0)"
                            f"{', a list of them' if name == 'eos_token_id' else ''} or null")
    section = values.get("mrope_section", ())
    if not isinstance(section, list | tuple) or not all(_is_int(s) and s >= 0 for s in section):
        problems.append(f"mrope_section is {_short(section)}; expected a list of whole numbers >= 0")
    layer_types = values.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list | tuple) or len(layer_types) > MAX_LAYERS
                                    or not all(isinstance(t, str) for t in layer_types)):
        problems.append(f"layer_types is {_short(layer_types)}; expected a list of at most {MAX_LAYERS} layer type "
                        f"names ('{LINEAR_ATTENTION}' or '{FULL_ATTENTION}'), one per layer")
    return problems


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _short(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a hostile value may be a huge list or string)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[:limit] + (f"... ({len(value)} entries)" if isinstance(value, list | tuple | str) else "...")


def default_layer_types(num_hidden_layers: int, full_attention_interval: int) -> tuple[str, ...]:
    """HF's rule: layer i is full attention when (i + 1) % interval == 0, linear attention otherwise."""
    return tuple(LINEAR_ATTENTION if (i + 1) % full_attention_interval else FULL_ATTENTION
                 for i in range(num_hidden_layers))


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig:
    """The text model's hyper-parameters (HF `Qwen3_5MoeTextConfig` names) plus our runtime choices."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 8
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    initializer_range: float = 0.02
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = 248044
    eos_token_id: int | tuple[int, ...] | None = 248044
    pad_token_id: int | None = None
    # runtime (ours; not part of the HF config)
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat_policy: str = "none"
    scan_layers: bool = True
    gdn_impl: str = "chunked"  # "auto" picks the Pallas kernel when tracing for TPU (run per shard under a mesh)
    gdn_chunk_size: int = 64
    moe_impl: str = "ragged"  # "ragged": sort + ragged_dot; "dense": all experts; "ep": expert parallel (moe_ep.py);
    # "blocked": batched matmuls over expert-aligned row blocks (moe_blocked.py; GPUs, where ragged_dot goes dense)
    moe_ep_round_factor: float = 2.0  # "ep": a dispatch round receives this x the balanced load n * k rows
    attention_impl: str = "dense"  # full forwards only (training, scoring); the decode path is always dense

    def __post_init__(self):
        self._raise_field_problems()
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers, 4))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    def _raise_field_problems(self) -> None:
        problems = field_problems({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if problems:  # before any rule below divides by a head count or measures a list
            raise ValueError("invalid Qwen35MoeConfig: " + "; ".join(problems))

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix when the configuration is inconsistent: first each field's
        type and range (`field_problems`), then the rules between fields."""
        self._raise_field_problems()
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                            f"{self.num_hidden_layers}; give one type per layer")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            problems.append(f"layer_types has unknown types {unknown}; use '{LINEAR_ATTENTION}' or '{FULL_ATTENTION}'")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                            f"linear_num_key_heads {self.linear_num_key_heads}")
        rotary = self.head_dim * self.partial_rotary_factor
        if rotary != int(rotary) or int(rotary) % 2:
            problems.append(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} = "
                            f"{rotary} must be an even integer")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                            f"({self.num_experts})")
        if self.remat_policy not in REMAT_POLICIES:
            problems.append(f"remat_policy {self.remat_policy!r} is not one of {REMAT_POLICIES}")
        if self.moe_impl not in MOE_IMPLS:
            problems.append(f"moe_impl {self.moe_impl!r} is not one of {MOE_IMPLS}")
        if self.attention_impl not in ATTENTION_IMPLS:
            problems.append(f"attention_impl {self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        if self.gdn_impl not in GDN_IMPLS:
            problems.append(f"gdn_impl {self.gdn_impl!r} is not one of {GDN_IMPLS}")
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError:
                problems.append(f"{name} {getattr(self, name)!r} is not a dtype name (e.g. 'float32', 'bfloat16')")
        if problems:
            raise ValueError("invalid Qwen35MoeConfig: " + "; ".join(problems))

    # ----------------------------------------------------------------------------------------------- derived
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_interval(self) -> int:
        """Distance between full-attention layers (the scan block length); the layer count if there are none."""
        first = [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]
        return first[0] + 1 if first else self.num_hidden_layers

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)

    def block_layout(self) -> tuple[tuple[str, ...], int, tuple[str, ...]]:
        """(pattern, n_blocks, tail): layers = pattern * n_blocks + tail, the scanned part first.

        The pattern is the first `full_attention_interval` layer types; as many whole repeats as match from the
        start are scanned, the rest run one by one. With `scan_layers` off, every layer is in the tail.
        """
        types = self.layer_types
        period = self.full_attention_interval
        pattern = types[:period]
        n_blocks = 0
        if self.scan_layers:
            while (n_blocks + 1) * period <= len(types) and types[n_blocks * period:(n_blocks + 1) * period] == pattern:
                n_blocks += 1
        if n_blocks == 0:
            return (), 0, types
        return pattern, n_blocks, types[n_blocks * period:]

    def replace(self, **changes) -> Qwen35MoeConfig:
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf(cls, hf_config: dict[str, Any] | str | Path, **runtime) -> Qwen35MoeConfig:
        """Build from an HF config dict or a path to `config.json` (composite or flat text config).

        `runtime` sets our own fields (dtype, remat_policy, ...). Unknown HF keys are ignored. A field of the
        wrong type or range, or fields that do not fit together (heads that do not divide, more experts per token
        than experts, a layer_types list of the wrong length), raise `BadConfigValue` naming the field, the value
        and what is expected, before any list or shape is derived from them.
        """
        if not isinstance(hf_config, dict):
            path = Path(hf_config)
            path = path / "config.json" if path.is_dir() else path
            hf_config = json.loads(path.read_text())
        text = hf_config.get("text_config", hf_config)
        if not isinstance(text, dict):
            raise BadConfigValue(f"text_config is {_short(text)}; expected an object of text-model fields")
        model_type = text.get("model_type", "qwen3_5_moe_text")
        if model_type not in ("qwen3_5_moe_text", "qwen3_5_moe"):
            raise BadConfigValue(f"config model_type is {model_type!r}; expected 'qwen3_5_moe_text' (a Qwen3.5-MoE "
                                 f"text config) or a composite 'qwen3_5_moe' config with a text_config")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise BadConfigValue(f"rope_parameters is {_short(rope)}; expected an object (rope_type, rope_theta, ...)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is implemented")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            raise BadConfigValue("config has no rope_theta (looked in rope_parameters and at the top level); "
                                 "Qwen3.5 uses 10000000 - add it to rope_parameters")
        field_names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in field_names and k not in _HF_IGNORED_KEYS}
        kwargs["rope_theta"] = theta
        kwargs["partial_rotary_factor"] = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        for key in ("mrope_section", "mrope_interleaved"):
            if key in rope:
                kwargs[key] = rope[key]
        if "tie_word_embeddings" in hf_config and "tie_word_embeddings" not in text:
            kwargs["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
        kwargs["num_hidden_layers"] = text.get("num_hidden_layers", cls.num_hidden_layers)
        interval = text.get("full_attention_interval", 4)
        layer_types = text.get("layer_types") or None
        problems = field_problems({**kwargs, "layer_types": layer_types,
                                   **({} if layer_types else {"full_attention_interval": interval})})
        if problems:  # before the layer list or any shape is derived from these values
            raise BadConfigValue("; ".join(problems))
        kwargs["rope_theta"] = float(theta)
        kwargs["partial_rotary_factor"] = float(kwargs["partial_rotary_factor"])
        kwargs["mrope_section"] = tuple(kwargs.get("mrope_section", cls.mrope_section))
        kwargs["layer_types"] = (tuple(layer_types) if layer_types
                                 else default_layer_types(kwargs["num_hidden_layers"], interval))
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
        try:
            config = cls(**kwargs)
        except ValueError as error:  # fields that do not fit together
            raise BadConfigValue(str(error).removeprefix("invalid Qwen35MoeConfig: ")) from None
        return config.replace(**runtime) if runtime else config

    def to_hf_text(self) -> dict[str, Any]:
        """The flat HF text config (`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`)."""
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved,
            },
            "attention_bias": False,
            "attention_dropout": 0.0,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": self.output_router_logits,
            "initializer_range": self.initializer_range,
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    def to_hf(self, *, composite: bool = True, dtype: str = "bfloat16") -> dict[str, Any]:
        """The released layout: composite `Qwen3_5MoeForConditionalGeneration` with `text_config` (text only)."""
        text = self.to_hf_text()
        text["dtype"] = dtype
        if not composite:
            return text
        text = {k: v for k, v in text.items() if k != "architectures"}
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings,
            "image_token_id": 248056,
            "video_token_id": 248057,
            "vision_start_token_id": 248053,
            "vision_end_token_id": 248054,
            "dtype": dtype,
        }


# ------------------------------------------------------------------------------------------------ presets
def qwen35_35b_a3b(**runtime) -> Qwen35MoeConfig:
    """Qwen3.5-35B-A3B: 40 layers (3 GDN + 1 attention) x 10, 256 experts top-8, width 512."""
    return Qwen35MoeConfig(**runtime)


def qwen35_122b_a10b(**runtime) -> Qwen35MoeConfig:
    return Qwen35MoeConfig(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                           linear_num_key_heads=16, linear_num_value_heads=64, moe_intermediate_size=1024,
                           shared_expert_intermediate_size=1024, num_experts=256, num_experts_per_tok=8,
                           layer_types=default_layer_types(48, 4), **runtime)


def qwen35_397b_a17b(**runtime) -> Qwen35MoeConfig:
    return Qwen35MoeConfig(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
                           linear_num_key_heads=16, linear_num_value_heads=64, moe_intermediate_size=1024,
                           shared_expert_intermediate_size=1024, num_experts=512, num_experts_per_tok=10,
                           layer_types=default_layer_types(60, 4), **runtime)


def tiny(vocab_size: int = 512, num_hidden_layers: int = 4, full_attention_interval: int = 4,
         **overrides) -> Qwen35MoeConfig:
    """A test-sized model with every mechanism of the real one (GQA, partial RoPE, GDN head repeat, MoE)."""
    fields = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=4096, rope_theta=1e7, partial_rotary_factor=0.25,
                  layer_types=default_layer_types(num_hidden_layers, full_attention_interval),
                  bos_token_id=None, eos_token_id=None)
    fields.update(overrides)
    return Qwen35MoeConfig(**fields)


PRESETS = {
    "qwen3.5-35b-a3b": qwen35_35b_a3b,
    "qwen3.5-122b-a10b": qwen35_122b_a10b,
    "qwen3.5-397b-a17b": qwen35_397b_a17b,
    "tiny": tiny,
}
