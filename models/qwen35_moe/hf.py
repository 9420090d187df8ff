"""Hugging Face checkpoint import (`load_hf`) and export (`save_hf`) for Qwen3.5-MoE.

Import reads a directory holding one `model.safetensors` or shards listed in `model.safetensors.index.json`,
tensor by tensor through safetensors' lazy slices: host memory holds at most one of our (layer-stacked) tensors
and the HF tensor it is being built from, never the whole checkpoint. Both name prefixes (`model.` and the
released `model.language_model.`) and both expert layouts (fused, unfused) load; `model.visual.*` and `mtp.*` are
skipped with a log line. Export writes the released text-only layout: a composite `config.json`,
`model.language_model.*` + `lm_head.weight`, sharded safetensors with an index; `A_log` and the GDN norm weight
stay fp32 unless `round_fp32_tensors=True`.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.hf_layout import (TensorSpec, experts_hf_tensors, gdn_fused_tensors, layer_specs,
                                         top_specs)
from models.qwen35_moe.model import Qwen35MoeForCausalLM

log = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
FP32_TENSOR_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")
EXPORT_PREFIX = "model.language_model."


class CheckpointError(ValueError):
    """A checkpoint does not match the configuration: names the tensor, the expected and the found shape."""


class CheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint directory (single file or sharded)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing_files = sorted({f for f in weight_map.values() if not (self.path / f).exists()})
            if missing_files:
                raise CheckpointError(f"{index} lists shard files that do not exist: {missing_files}")
            self.name_to_file = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files and no model.safetensors.index.json in {self.path}")
            self.name_to_file = {}
            for file in files:
                with safe_open(file, framework="numpy") as f:
                    self.name_to_file.update({name: file for name in f.keys()})
        self.skipped = sorted(n for n in self.name_to_file if n.startswith(SKIPPED_PREFIXES))
        if self.skipped:
            towers = sorted({n.split(".")[0] if n.startswith("mtp.") else ".".join(n.split(".")[:2])
                             for n in self.skipped})
            log.info("skipping %d tensors of non-text towers (%s)", len(self.skipped), ", ".join(towers))
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.")
                                                     for n in self.name_to_file) else "model."
        self.used: set[str] = set()
        self._handles: dict[Path, object] = {}

    def full_name(self, name: str, layer_prefix: str = "") -> str:
        return name[1:] if name.startswith("/") else self.prefix + layer_prefix + name

    def has(self, name: str) -> bool:
        return name in self.name_to_file

    def shape(self, full_name: str) -> tuple[int, ...]:
        return tuple(self._open(full_name).get_slice(full_name).get_shape())

    def fetch(self, full_name: str, rows: tuple[int, int] | None = None, axis: int = 0) -> np.ndarray:
        handle = self._open(full_name)
        self.used.add(full_name)
        if rows is None:
            return handle.get_tensor(full_name)
        index = (slice(None),) * axis + (slice(*rows),)
        return handle.get_slice(full_name)[index]

    def unused(self) -> list[str]:
        return sorted(set(self.name_to_file) - self.used - set(self.skipped))

    def _open(self, full_name: str):
        if full_name not in self.name_to_file:
            raise KeyError(full_name)
        file = self.name_to_file[full_name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="numpy").__enter__()
        return self._handles[file]


def _layer_experts_layout(reader: CheckpointReader, layer: int) -> str:
    base = f"{reader.prefix}layers.{layer}.mlp.experts."
    if reader.has(base + "gate_up_proj"):
        return "fused"
    if reader.has(base + "0.gate_proj.weight"):
        return "unfused"
    raise CheckpointError(f"checkpoint has no routed experts for layer {layer}: expected {base}gate_up_proj "
                          f"(fused) or {base}0.gate_proj.weight (unfused)")


def _read_spec(reader: CheckpointReader, spec: TensorSpec, layer_prefix: str, what: str) -> np.ndarray:
    expected = dict(zip(spec.hf_names, spec.hf_shapes))
    for name in spec.hf_names:
        full = reader.full_name(name, layer_prefix)
        if not reader.has(full):
            raise CheckpointError(f"checkpoint has no tensor {full} (expected {what}, shape {expected[name]})")
        found = reader.shape(full)
        if found != tuple(expected[name]):
            raise CheckpointError(f"tensor {full} has shape {found}, expected {tuple(expected[name])} "
                                  f"({what}); the checkpoint does not match its config")

    def fetch(name, rows=None, axis=0):
        return reader.fetch(reader.full_name(name, layer_prefix), rows=rows, axis=axis)

    return spec.read(fetch)


def _layer_index_of(path: tuple, cfg: Qwen35MoeConfig) -> tuple[list[int], tuple]:
    """For our parameter path: the HF layer indices it stacks (or [] for top-level) and the in-layer path."""
    pattern, n_blocks, _ = cfg.block_layout()
    if path[:3] == ("model", "blocks", "layers"):
        j = path[3]
        return [b * len(pattern) + j for b in range(n_blocks)], path[4:]
    if path[:2] == ("model", "tail"):
        return [n_blocks * len(pattern) + path[2]], path[3:]
    return [], path


def load_hf(path: str | Path, *, dtype=jnp.float32, mesh=None, rules=None, strict: bool = True,
            **runtime) -> Qwen35MoeForCausalLM:
    """Load an HF Qwen3.5-MoE checkpoint directory into our model with parameters in `dtype`.

    `runtime` sets our config fields (compute `dtype` name is `compute_dtype=...`, remat_policy, ...). With a
    `mesh`, each parameter is placed with its logical-axis sharding as soon as it is built. `strict` makes
    unexpected tensors an error (they are listed); otherwise they are logged.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json; pass the directory of an HF Qwen3.5-MoE checkpoint")
    compute = runtime.pop("compute_dtype", None)
    if compute is not None:
        runtime["dtype"] = jnp.dtype(compute).name
    cfg = Qwen35MoeConfig.from_hf(path, param_dtype=jnp.dtype(dtype).name, **runtime)
    reader = CheckpointReader(path)
    abstract = nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is not None:
        from mercury_jax.parallel.sharding import DEFAULT_RULES, variable_sharding
        rules = rules or DEFAULT_RULES

    layouts: dict[int, str] = {}
    top = {spec.path: spec for spec in top_specs(cfg)}
    flat = nnx.to_flat_state(abstract_state)
    for var_path, variable in flat:
        layers, inner = _layer_index_of(tuple(var_path), cfg)
        if layers:
            parts = []
            for layer in layers:
                if layer not in layouts:
                    layouts[layer] = _layer_experts_layout(reader, layer)
                specs = {s.path: s for s in layer_specs(cfg, cfg.layer_types[layer], layouts[layer])}
                spec = specs[inner]
                parts.append(_read_spec(reader, spec, f"layers.{layer}.",
                                        f"{cfg.layer_types[layer]} layer {layer}, our {'.'.join(map(str, inner))}"))
            value = np.stack(parts) if tuple(var_path[:2]) == ("model", "blocks") else parts[0]
        else:
            spec = top[tuple(var_path)]
            value = _read_spec(reader, spec, "", "top-level " + ".".join(map(str, var_path)))
        if value.shape != variable.shape:
            raise CheckpointError(f"built {'.'.join(map(str, var_path))} with shape {value.shape}, model expects "
                                  f"{variable.shape}")
        value = value.astype(jnp.dtype(dtype))
        if mesh is not None:
            array = jax.device_put(value, variable_sharding(var_path, variable, mesh, rules))
        else:
            array = jnp.asarray(value)
        variable.set_value(array)
        del value
    unexpected = reader.unused()
    if unexpected:
        message = (f"checkpoint has {len(unexpected)} tensors this model does not use: "
                   f"{unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
        if strict:
            raise CheckpointError(message + "; check the config matches the checkpoint, or pass strict=False")
        log.warning(message)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# --------------------------------------------------------------------------------------------------- export
def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or '500MB'")
    unit = match.group(2).upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(match.group(1)) * scale)


def _model_layer_arrays(model: Qwen35MoeForCausalLM) -> Iterator[tuple[int, dict]]:
    """(layer index, nested dict of numpy arrays of that layer in our layout), one layer at a time."""
    cfg = model.config
    pattern, n_blocks, tail = cfg.block_layout()
    if n_blocks:
        block_state = nnx.state(model.model.blocks)
        for j in range(len(pattern)):
            layer_state = nnx.to_pure_dict(block_state["layers"][j])
            host = jax.tree.map(lambda a: np.asarray(jax.device_get(a)), layer_state)
            for b in range(n_blocks):
                yield b * len(pattern) + j, jax.tree.map(lambda a: a[b], host)
    for k, layer in enumerate(model.model.tail):
        yield n_blocks * len(pattern) + k, jax.tree.map(lambda a: np.asarray(jax.device_get(a)),
                                                        nnx.to_pure_dict(nnx.state(layer)))


def _get(tree: dict, path: tuple) -> np.ndarray:
    for key in path:
        tree = tree[key]
    return tree


def hf_tensors(model: Qwen35MoeForCausalLM, *, experts: str = "fused", prefix: str = EXPORT_PREFIX
               ) -> Iterator[tuple[str, np.ndarray]]:
    """Every HF tensor of the model (name, array in the param dtype), layer by layer."""
    cfg = model.config
    top_state = {"model": {"embed": np.asarray(model.model.embed[...]),
                           "final_norm": {"weight": np.asarray(model.model.final_norm.weight[...])}}}
    if not cfg.tie_word_embeddings:
        top_state["lm_head"] = np.asarray(model.lm_head[...])
    for spec in top_specs(cfg):
        for name, array in spec.write(_get(top_state, spec.path)).items():
            yield (name[1:] if name.startswith("/") else prefix + name), array
    del top_state
    for layer, arrays in sorted(_model_layer_arrays(model), key=lambda item: item[0]):
        layer_prefix = f"{prefix}layers.{layer}."
        for spec in layer_specs(cfg, cfg.layer_types[layer], experts):
            if spec.write is not None:
                for name, array in spec.write(_get(arrays, spec.path)).items():
                    yield layer_prefix + name, array
        if "A_log" in arrays["mixer"]:
            for name, array in gdn_fused_tensors(cfg, arrays["mixer"]).items():
                yield layer_prefix + name, array
        for name, array in experts_hf_tensors(cfg, arrays["moe"], experts).items():
            yield layer_prefix + name, array


def save_hf(model: Qwen35MoeForCausalLM, path: str | Path, *, dtype=jnp.bfloat16, experts: str = "fused",
            max_shard_size: int | str = "5GB", round_fp32_tensors: bool = False, composite: bool = True) -> Path:
    """Write `model` as an HF checkpoint directory (released text-only layout) and return its path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)
    prefix = EXPORT_PREFIX if composite else "model."
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()

    # Shards are written as they fill (host memory holds one shard), then renamed once their count is known.
    parts: list[tuple[Path, list[str]]] = []
    current: dict[str, np.ndarray] = {}
    current_bytes = total = 0

    def flush():
        part = path / f"model-part-{len(parts) + 1:05d}.safetensors.tmp"
        save_file(current, str(part), metadata={"format": "pt"})
        parts.append((part, list(current)))

    for name, array in hf_tensors(model, experts=experts, prefix=prefix):
        target = np.float32 if (name.endswith(FP32_TENSOR_SUFFIXES) and not round_fp32_tensors) else np_dtype
        array = np.ascontiguousarray(array.astype(target))
        if current and current_bytes + array.nbytes > limit:
            flush()
            current, current_bytes = {}, 0
        current[name] = array
        current_bytes += array.nbytes
        total += array.nbytes
    flush()
    if len(parts) == 1:
        parts[0][0].rename(path / "model.safetensors")
    else:
        weight_map = {}
        for i, (part, names) in enumerate(parts):
            file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            part.rename(path / file)
            weight_map.update({name: file for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dtype_name = "bfloat16" if np_dtype == np.dtype(ml_dtypes.bfloat16) else np_dtype.name
    config = model.config.to_hf(composite=composite, dtype=dtype_name)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
