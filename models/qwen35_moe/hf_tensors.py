"""Our parameters -> the HF tensors of the released layout, one tensor at a time, from any store of our arrays.

An `ArraySource` is `read(name, index, dtype) -> np.ndarray`: our parameter `name` (its path from the model root as
strings, ("model", "blocks", "layers", "0", "mixer", "q_proj")), row `index` of its leading axis when the
parameter is a scanned stack ([n_blocks, ...]; None: the whole array), as a host array cast to `dtype` (None: as
stored). `model_arrays(model)` reads an in-memory model; `mercury_jax.runs.checkpoint_tensors` reads an Orbax
checkpoint. `hf_tensor_stream` asks the source for each array only when the HF tensor built from it is next, so a
consumer that writes each tensor before taking the next holds about one layer's tensor at a time.

Casting happens when an array is read, before any transpose or concatenation: those move elements without changing
them, so the bytes are those of casting the finished HF tensor.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import numpy as np
from flax import nnx

from models.qwen35_moe.config import Qwen35MoeConfig
from models.qwen35_moe.hf_layout import TensorSpec, experts_hf_tensors, gdn_fused_tensors, layer_specs, top_specs

ArraySource = Callable[[tuple[str, ...], "int | None", "np.dtype | None"], np.ndarray]

EXPORT_PREFIX = "model.language_model."
FP32_TENSOR_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")  # kept fp32 in a bf16 export


def parameter_of(cfg: Qwen35MoeConfig, layer: int, path: tuple[str, ...]) -> tuple[tuple[str, ...], int | None]:
    """(our parameter's name from the model root, row of its stacked leading axis or None) holding `path` of decoder
    layer `layer`: layer b * len(pattern) + j is row b of `model.blocks.layers.j`, the rest `model.tail.k`."""
    pattern, n_blocks, _ = cfg.block_layout()
    scanned = n_blocks * len(pattern)
    if layer < scanned:
        block, j = divmod(layer, len(pattern))
        return ("model", "blocks", "layers", str(j), *path), block
    return ("model", "tail", str(layer - scanned), *path), None


def model_arrays(model) -> ArraySource:
    """An `ArraySource` over a model's parameters (on any device; each read copies one array or row to the host)."""
    variables = {tuple(str(k) for k in path): variable for path, variable in nnx.to_flat_state(nnx.state(model))}

    def read(name, index, dtype):
        value = variables[name][...]
        host = np.asarray(jax.device_get(value if index is None else value[index]))
        return host if dtype is None else host.astype(dtype, copy=False)
    return read


def hf_tensor_stream(cfg: Qwen35MoeConfig, read: ArraySource, *, experts: str = "fused", prefix: str = EXPORT_PREFIX,
                     dtype=None, round_fp32_tensors: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Every HF tensor of the model (full name, array), top-level tensors first, then layer by layer. With `dtype`,
    each in the dtype the export writes it in: `dtype`, except fp32 for names ending in `FP32_TENSOR_SUFFIXES`
    unless `round_fp32_tensors`; without, in the stored dtype."""
    def dtype_for(spec: TensorSpec):
        if dtype is None:
            return None
        kept = not round_fp32_tensors and any(n.endswith(FP32_TENSOR_SUFFIXES) for n in spec.hf_names)
        return np.dtype(np.float32) if kept else dtype

    for spec in top_specs(cfg):
        for name, array in spec.write(read(spec.path, None, dtype_for(spec))).items():
            yield (name[1:] if name.startswith("/") else prefix + name), array
            del array
    for layer, layer_type in enumerate(cfg.layer_types):
        layer_prefix = f"{prefix}layers.{layer}."
        specs = {spec.path: spec for spec in layer_specs(cfg, layer_type, experts)}

        def fetch(path, layer=layer, specs=specs):
            return read(*parameter_of(cfg, layer, path), dtype_for(specs[path]))

        for path, spec in specs.items():
            if spec.write is not None:
                yield from _prefixed(layer_prefix, spec.write(fetch(path)).items())
        fused_mixer = [path for path, spec in specs.items() if spec.write is None and path[0] == "mixer"]
        if fused_mixer:
            yield from _prefixed(layer_prefix, gdn_fused_tensors(cfg, {p[1]: fetch(p) for p in fused_mixer}).items())
        yield from _prefixed(layer_prefix, experts_hf_tensors(cfg, lambda key, fetch=fetch: fetch(("moe", key)),
                                                              experts))


def _prefixed(prefix: str, tensors) -> Iterator[tuple[str, np.ndarray]]:
    for name, array in tensors:
        yield prefix + name, array
        del array  # not alive while the next tensor is built
