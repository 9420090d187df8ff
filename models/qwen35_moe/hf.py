"""Hugging Face checkpoint import (`load_hf`) and export (`save_hf`) for Qwen3.5-MoE.

Import reads a directory holding one `model.safetensors` or shards listed in `model.safetensors.index.json`,
tensor by tensor through safetensors' lazy slices: host memory holds at most one of our (layer-stacked) tensors
and the HF tensor it is being built from, never the whole checkpoint. Both name prefixes (`model.` and the
released `model.language_model.`) and both expert layouts (fused, unfused) load; `model.visual.*` and `mtp.*` are
skipped with a log line. A damaged or inconsistent checkpoint raises a `CheckpointError` subclass naming the
tensor or file and the fix (`checkpoint_reader` checks the files; `config.from_hf` each config field's type and
range; here: the expert count against the checkpoint, then shapes, dtypes, NaN/inf).

Export writes the released text-only layout: a composite `config.json`, `model.language_model.*` +
`lm_head.weight`, sharded safetensors with an index; `A_log` and the GDN norm weight stay fp32 unless
`round_fp32_tensors=True`. It streams: each HF tensor is built from our arrays when it is next (`hf_tensors`, from
a model or any `ArraySource`, e.g. an Orbax checkpoint) and written into its shard (`safetensors_shards`), so host
memory holds about one tensor, not a shard or the model. It replaces an existing export atomically (`atomic_dir`):
a reader finds the old export or the new one, whole, whatever instant the writer is killed at.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import re
import shutil
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mercury_jax.parallel.sharding import DEFAULT_RULES, variable_sharding
from models.qwen35_moe.atomic_dir import committed_dir, replace_directory
from models.qwen35_moe.checkpoint_errors import (
    BadConfigValue,
    CheckpointDtypeError,
    CheckpointError,
    CorruptShardError,
    DuplicateTensorError,
    MissingShardError,
    NonFiniteWeightError,
    ShardIndexError,
    ShardPathError,
    SymlinkLoopError,
)
from models.qwen35_moe.checkpoint_reader import INDEX_NAME, CheckpointReader, check_file
from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.hf_layout import TensorSpec, layer_specs, top_specs
from models.qwen35_moe.hf_tensors import EXPORT_PREFIX, ArraySource, hf_tensor_stream, model_arrays
from models.qwen35_moe.model import Qwen35MoeForCausalLM
from models.qwen35_moe.safetensors_shards import ShardedSafetensors

__all__ = ["BadConfigValue", "CheckpointDtypeError", "CheckpointError", "CheckpointReader", "CorruptShardError",
           "DuplicateTensorError", "MissingShardError", "NonFiniteWeightError", "ShardIndexError", "ShardPathError",
           "SymlinkLoopError", "hf_tensors", "load_hf", "save_hf", "write_hf"]

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtype codes a weight may be stored in
# What an export writes (replaced on overwrite); other entries of an existing export directory are kept. The last
# pattern is the temporary shard name of earlier, non-atomic versions of `save_hf`.
EXPORT_FILE_PATTERNS = ("model*.safetensors", INDEX_NAME, "config.json", "model-part-*.safetensors.tmp")


def _layer_experts_layout(reader: CheckpointReader, layer: int) -> str:
    base = f"{reader.prefix}layers.{layer}.mlp.experts."
    if reader.has(base + "gate_up_proj"):
        return "fused"
    if reader.has(base + "0.gate_proj.weight"):
        return "unfused"
    raise CheckpointError(f"checkpoint has no routed experts for layer {layer}: expected {base}gate_up_proj "
                          f"(fused) or {base}0.gate_proj.weight (unfused)")


def _read_spec(reader: CheckpointReader, spec: TensorSpec, layer_prefix: str, what: str
               ) -> tuple[np.ndarray, list[str]]:
    """Our array for `spec` and the full HF names it was built from."""
    expected = dict(zip(spec.hf_names, spec.hf_shapes))
    sources = []
    for name in spec.hf_names:
        full = reader.full_name(name, layer_prefix)
        if not reader.has(full):
            raise CheckpointError(f"checkpoint has no tensor {full} (expected {what}, shape {expected[name]})")
        found = reader.shape(full)
        if found != tuple(expected[name]):
            raise CheckpointError(f"tensor {full} has shape {found}, expected {tuple(expected[name])} "
                                  f"({what}); the checkpoint does not match its config")
        stored = reader.dtype(full)
        if stored not in FLOAT_DTYPES:
            raise CheckpointDtypeError(
                f"tensor {full} in {reader.file_of(full)} is stored as {stored}, not a float dtype "
                f"({'/'.join(FLOAT_DTYPES)}); casting it to float would load wrong weights for {what}. A quantized "
                f"checkpoint must be dequantized first; otherwise re-export the checkpoint in bf16 or fp32")
        sources.append(full)

    def fetch(name, rows=None, axis=0):
        return reader.fetch(reader.full_name(name, layer_prefix), rows=rows, axis=axis)

    return spec.read(fetch), sources


def _all_finite(value: np.ndarray, chunk: int = 1 << 24) -> bool:
    """No NaN/inf in `value`; checked in chunks so the boolean temporary stays small for stacked expert weights."""
    flat = value.reshape(-1)
    return all(np.isfinite(flat[i:i + chunk]).all() for i in range(0, flat.size, chunk))


def _raise_nonfinite(reader: CheckpointReader, sources: list[str], what: str, dtype) -> None:
    """Name the HF tensor holding NaN/inf (re-read on this error path only), or report an overflowing cast."""
    for full in dict.fromkeys(sources):
        tensor = reader.fetch(full)
        if _all_finite(tensor):
            continue
        n_nan, n_inf = int(np.isnan(tensor).sum()), int(np.isinf(tensor).sum())
        raise NonFiniteWeightError(
            f"tensor {full} in {reader.file_of(full)} holds {n_nan} NaN and {n_inf} inf values (of {tensor.size}); "
            f"the checkpoint is damaged or comes from a diverged run: re-download it or export an earlier "
            f"checkpoint (pass allow_nonfinite=True to load it anyway)")
    raise NonFiniteWeightError(
        f"{what} overflows {jnp.dtype(dtype).name} when cast (its checkpoint tensors {list(dict.fromkeys(sources))} "
        f"are finite); load with dtype=jnp.float32 (or pass allow_nonfinite=True)")


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
            allow_nonfinite: bool = False, **runtime) -> Qwen35MoeForCausalLM:
    """Load an HF Qwen3.5-MoE checkpoint directory into our model with parameters in `dtype`.

    `runtime` sets our config fields (compute `dtype` name is `compute_dtype=...`, remat_policy, ...). With a
    `mesh`, each parameter is placed with its logical-axis sharding as soon as it is built. `strict` makes
    unexpected tensors an error (they are listed); otherwise they are logged. Every parameter is checked for
    NaN/inf as it is built (after the cast to `dtype`); `allow_nonfinite=True` skips the check. A directory whose
    `save_hf` was interrupted loads the export that save left committed (see `atomic_dir`).
    """
    requested = Path(path)
    path = committed_dir(requested)
    if not check_file(path / "config.json", "the model config"):
        raise CheckpointError(f"{requested} has no config.json; pass the directory of an HF Qwen3.5-MoE checkpoint")
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptShardError(f"{path / 'config.json'} is not valid JSON ({error}); re-download it or re-export "
                                f"the checkpoint") from None
    compute = runtime.pop("compute_dtype", None)
    if compute is not None:
        runtime["dtype"] = jnp.dtype(compute).name
    try:
        cfg = Qwen35MoeConfig.from_hf(hf_config, param_dtype=jnp.dtype(dtype).name, **runtime)
    except BadConfigValue as error:
        raise BadConfigValue(f"{path / 'config.json'}: {error}; fix the file (or re-export the checkpoint)") from None
    reader = CheckpointReader(path)
    try:
        _check_expert_count(reader, cfg, path / "config.json")
        return _build(reader, cfg, dtype=dtype, mesh=mesh, rules=rules, strict=strict,
                      allow_nonfinite=allow_nonfinite)
    finally:
        reader.close()


def _check_expert_count(reader: CheckpointReader, cfg: Qwen35MoeConfig, config_path: Path) -> None:
    """`num_experts` against the experts an unfused checkpoint stores (`layers.L.mlp.experts.E.gate_proj.weight`),
    counted from the shard index alone before the loader builds its name list of 3 tensors per expert per layer: a
    hostile `num_experts` would otherwise make that list first. (A fused checkpoint names one tensor per layer; its
    shape check catches a wrong count.)"""
    unfused = re.compile(rf"{re.escape(reader.prefix)}layers\.(\d+)\.mlp\.experts\.\d+\.gate_proj\.weight")
    stored: dict[int, int] = {}
    for name in reader.name_to_file:
        if match := unfused.fullmatch(name):
            stored[int(match.group(1))] = stored.get(int(match.group(1)), 0) + 1
    for layer, count in sorted(stored.items()):
        if count != cfg.num_experts:
            raise BadConfigValue(f"{config_path}: num_experts is {cfg.num_experts}, but layer {layer} of the "
                                 f"checkpoint stores {count} unfused experts (mlp.experts.N.gate_proj.weight); set "
                                 f"num_experts to the count the checkpoint holds")


def _abstract_model(cfg: Qwen35MoeConfig):
    """Graph and abstract state of the model for `cfg`: tracing the init takes seconds, so it is done once per
    (hashable) config; callers copy the state before filling it."""
    try:
        return _traced_abstract_model(cfg)
    except TypeError:  # a runtime override made the config unhashable
        return _traced_abstract_model.__wrapped__(cfg)


@functools.lru_cache(maxsize=8)
def _traced_abstract_model(cfg: Qwen35MoeConfig):
    return nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))))


def _build(reader: CheckpointReader, cfg: Qwen35MoeConfig, *, dtype, mesh, rules, strict: bool,
           allow_nonfinite: bool) -> Qwen35MoeForCausalLM:
    graphdef, cached_state = _abstract_model(cfg)
    abstract_state = copy.deepcopy(cached_state)  # its variables are filled in place below
    if mesh is not None:
        rules = rules or DEFAULT_RULES

    layouts: dict[int, str] = {}
    top = {spec.path: spec for spec in top_specs(cfg)}
    flat = nnx.to_flat_state(abstract_state)
    for var_path, variable in flat:
        layers, inner = _layer_index_of(tuple(var_path), cfg)
        sources: list[str] = []
        if layers:
            parts = []
            for layer in layers:
                if layer not in layouts:
                    layouts[layer] = _layer_experts_layout(reader, layer)
                specs = {s.path: s for s in layer_specs(cfg, cfg.layer_types[layer], layouts[layer])}
                spec = specs[inner]
                part, names = _read_spec(reader, spec, f"layers.{layer}.", f"{cfg.layer_types[layer]} layer "
                                         f"{layer}, our {'.'.join(map(str, inner))}")
                parts.append(part)
                sources += names
            value = np.stack(parts) if tuple(var_path[:2]) == ("model", "blocks") else parts[0]
        else:
            spec = top[tuple(var_path)]
            value, sources = _read_spec(reader, spec, "", "top-level " + ".".join(map(str, var_path)))
        if value.shape != variable.shape:
            raise CheckpointError(f"built {'.'.join(map(str, var_path))} with shape {value.shape}, model expects "
                                  f"{variable.shape}")
        with np.errstate(over="ignore"):  # an overflow becomes inf, which the check below reports
            value = value.astype(jnp.dtype(dtype))
        if not allow_nonfinite and not _all_finite(value):
            _raise_nonfinite(reader, sources, "our " + ".".join(map(str, var_path)), dtype)
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


def hf_tensors(model: Qwen35MoeForCausalLM, *, experts: str = "fused", prefix: str = EXPORT_PREFIX
               ) -> Iterator[tuple[str, np.ndarray]]:
    """Every HF tensor of the model (name, array in the param dtype), layer by layer, one at a time."""
    return hf_tensor_stream(model.config, model_arrays(model), experts=experts, prefix=prefix)


def save_hf(model: Qwen35MoeForCausalLM, path: str | Path, *, dtype=jnp.bfloat16, experts: str = "fused",
            max_shard_size: int | str = "5GB", round_fp32_tensors: bool = False, composite: bool = True,
            extra_files: dict[str, str | bytes | Path] | None = None) -> Path:
    """Write `model` as an HF checkpoint directory (released text-only layout) and return its path.

    Atomic (protocol in `atomic_dir`): the export is written into the sibling `.{name}.save-new`, fsynced, and
    swapped in for `path` by two renames; the old export is parked as `.{name}.save-old` until the swap is done.
    Killed at any instant, `path` (as `load_hf` reads it) holds the old export or the new one, whole; the next
    save finishes or discards the interrupted one and leaves neither sibling behind. Entries of an existing
    `path` that an export does not write (tokenizer files, chat template, ...) are carried over by hard link;
    its old weights, index and config are replaced. `extra_files` (file name -> text, bytes, or a `Path` to copy)
    are written inside the same swap, e.g. tokenizer files and a chat template. One writer per `path` at a time.
    """
    return write_hf(model.config, model_arrays(model), path, dtype=dtype, experts=experts,
                    max_shard_size=max_shard_size, round_fp32_tensors=round_fp32_tensors, composite=composite,
                    extra_files=extra_files)


def write_hf(cfg: Qwen35MoeConfig, read: ArraySource, path: str | Path, *, dtype=jnp.bfloat16, experts: str = "fused",
             max_shard_size: int | str = "5GB", round_fp32_tensors: bool = False, composite: bool = True,
             extra_files: dict[str, str | bytes | Path] | None = None) -> Path:
    """`save_hf` of the model `cfg` whose parameters `read` gives (`hf_tensors.ArraySource`), tensor by tensor:
    host memory holds one HF tensor (and the arrays it is built from) and a copy buffer, never a shard."""
    extra_files = dict(extra_files or {})
    for name in extra_files:
        if Path(name).name != name or name in ("", ".", "..") or not _is_kept(name):
            raise ValueError(f"extra_files name {name!r} must be a plain file name that save_hf does not write "
                             f"itself (not {EXPORT_FILE_PATTERNS})")
    limit = _parse_size(max_shard_size)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)
    prefix = EXPORT_PREFIX if composite else "model."
    dtype_name = "bfloat16" if np_dtype == np.dtype(ml_dtypes.bfloat16) else np_dtype.name
    config = cfg.to_hf(composite=composite, dtype=dtype_name)

    with replace_directory(path, keep_old=lambda name: _is_kept(name) and name not in extra_files) as staging:
        with ShardedSafetensors(staging, limit) as shards:
            for name, array in hf_tensor_stream(cfg, read, experts=experts, prefix=prefix, dtype=np_dtype,
                                                round_fp32_tensors=round_fp32_tensors):
                shards.add(name, array)
                del array  # the next tensor is built without this one alive
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in extra_files.items():
            if isinstance(content, Path):
                shutil.copyfile(content, staging / name)
            else:
                (staging / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return Path(path)


def _is_kept(name: str) -> bool:
    """Whether an entry of an existing export directory survives an overwrite (save_hf does not write it)."""
    return not any(fnmatch(name, pattern) for pattern in EXPORT_FILE_PATTERNS)
