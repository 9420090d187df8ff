"""The model a config's `model` section names: its runtime fields, the preset's model config, and the model
itself (from an HF checkpoint or a preset, fp32 master weights, optionally created straight into a mesh)."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_collections
from flax import nnx

from mercury_jax.parallel import init_sharded
from models.qwen35_moe import Qwen35MoeForCausalLM, load_hf
from models.qwen35_moe.config import PRESETS

RUNTIME_FIELDS = ("dtype", "remat_policy", "moe_impl", "moe_ep_round_factor", "attention_impl", "gdn_impl")


def model_runtime(cfg: ml_collections.ConfigDict) -> dict:
    """The model config fields a run sets (`RUNTIME_FIELDS`: compute dtype and implementations) from its `model`
    section; a field the section lacks (an older run's config.json) keeps the model's default."""
    return {name: cfg[name] for name in RUNTIME_FIELDS if name in cfg}


def preset_config(cfg: ml_collections.ConfigDict, vocab_size: int, preset: str = ""):
    """The model config of a run built from a preset (`cfg.preset`, or `preset` for shapes alone) with the run's
    runtime fields; the `tiny` preset takes `cfg.overrides` and the tokenizer's vocabulary rounded up to 64."""
    name = preset or cfg.preset
    if name not in PRESETS:
        raise ValueError(f"model.preset {name!r} is not one of {sorted(PRESETS)}")
    runtime = model_runtime(cfg)
    if name == "tiny":
        return PRESETS["tiny"](vocab_size=-(-vocab_size // 64) * 64, **runtime, **cfg.overrides.to_dict())
    return PRESETS[name](**runtime)


def build_model(cfg: ml_collections.ConfigDict, vocab_size: int, seed: int, *, mesh=None) -> Qwen35MoeForCausalLM:
    """From an HF checkpoint (`hf_path`) or from scratch (`preset` + `overrides`), fp32 master weights. With a
    `mesh`, created straight into its sharding there: a checkpoint tensor by tensor (`load_hf(mesh=)`), a preset
    by abstract shapes and a sharded jitted init (`parallel.init_sharded`: an eager init's values to an fp32 ulp;
    a one-device mesh keeps the eager init, so the tiny demos reproduce their recorded runs bit for bit)."""
    if cfg.hf_path:
        if not Path(cfg.hf_path).exists():
            raise FileNotFoundError(f"model.hf_path {cfg.hf_path} does not exist; point it at an HF checkpoint "
                                    f"directory or set model.hf_path='' and model.preset='tiny'")
        runtime = model_runtime(cfg)
        return load_hf(cfg.hf_path, dtype=jnp.float32, compute_dtype=runtime.pop("dtype"), mesh=mesh, **runtime)
    model_cfg = preset_config(cfg, vocab_size)
    def make():
        return Qwen35MoeForCausalLM(model_cfg, rngs=nnx.Rngs(seed))
    if mesh is None or mesh.size == 1:  # one device holds it whole anyway: the eager init's exact values
        return make()
    return init_sharded(make, mesh)
