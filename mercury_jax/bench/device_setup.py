"""What the device check runs on one chip: a run's shapes per chip, and its model cut to a few blocks of its layer
pattern with the kernels that exist on the platform."""
from __future__ import annotations

import dataclasses
import math

import jax

from mercury_jax.bench.run_config import model_config
from mercury_jax.rollout.replicas import slots_per_replica
from mercury_jax.rollout.settings import EngineSettings
from models.qwen35_moe.config import Qwen35MoeConfig

# Per platform: Pallas Mosaic kernels on TPU; elsewhere the pure-JAX chunked GDN and blockwise attention (CPU takes
# the GPU's choice, so CI keeps that path alive). One chip has no expert axis to dispatch over: on TPU sort +
# ragged_dot (XLA's grouped matmul); elsewhere XLA rewrites ragged_dot into a dense masked dot over all experts (its
# weight gradient alone [E, N k, H]: 200 GB at the released row), so batched matmuls over expert-aligned row blocks.
KERNELS = {
    "tpu": {"gdn_impl": "pallas", "attention_impl": "splash", "moe_impl": "ragged"},
    "gpu": {"gdn_impl": "chunked", "attention_impl": "blockwise", "moe_impl": "blocked"},
    "cpu": {"gdn_impl": "chunked", "attention_impl": "blockwise", "moe_impl": "blocked"},
}
RELEASED_PRESET = "qwen3.5-35b-a3b"  # the architecture of a run that loads an HF checkpoint


def platform() -> str:
    """"tpu", "gpu" or "cpu": the default backend, a CUDA or ROCm plugin's named "gpu"."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


@dataclasses.dataclass(frozen=True)
class Shapes:
    """One chip's share of a run: the actor step over `rows` x `seq` tokens in `micro_batches` micro-batches, and
    one rollout replica's decode chunk of `steps` steps for `slots` slots with `cache_length`-token caches."""
    rows: int
    micro_batches: int
    seq: int
    slots: int
    cache_length: int
    steps: int


def chip_shapes(config) -> Shapes:
    """The shapes the run's programs have on one chip: one micro-batch of the actor step (the rows a chip takes,
    `sao.batch_prompts` over `devices.actor` or all of them when the roles share one device, over
    `sao.actor_micro_batches`), every row `rollout.max_total_tokens` (the worst case), as a step of its own; and a
    replica's slots (`rollout.num_slots` over the `devices.rollout / |replica|` replicas) with caches of
    `max_total_tokens`, `steps_per_sync` steps a chunk.

    One micro-batch rather than the chip's whole step: on one chip the step holds the whole model's fp32 weights,
    Adam moments and gradient accumulator, not a 1 / fsdp share of them (the released 4 rows in 4 micro-batches at
    4 layers need 150 GiB on a v5p chip, one micro-batch 85 GiB); the optimiser update, once per step, is then
    counted once per micro-batch."""
    s, r = config.sao, config.rollout
    rows = s.batch_prompts // max(config.devices.actor, 1)
    replica = dict(r.get("replica", {}) or {})
    replicas = max(config.devices.rollout, 1) // math.prod(replica.values()) if replica else 1
    return Shapes(rows=max(rows // s.actor_micro_batches, 1), micro_batches=1, seq=r.max_total_tokens,
                  slots=slots_per_replica(r.num_slots, replicas), cache_length=r.max_total_tokens,
                  steps=r.get("steps_per_sync", EngineSettings().steps_per_sync))


def check_model(config, *, blocks: int, vocab: int, kernels: dict) -> Qwen35MoeConfig:
    """The run's model architecture (its preset, else the released 35B-A3B's) with the run's runtime fields, cut to
    `blocks` repeats of its layer pattern (3 GDN + 1 attention for the released model), every other width kept,
    vocabulary `vocab` (0: the architecture's), and `kernels` (config field -> value)."""
    cfg = model_config(config, RELEASED_PRESET)
    pattern, _, _ = cfg.block_layout()
    layer_types = pattern * blocks
    return cfg.replace(num_hidden_layers=len(layer_types), layer_types=layer_types,
                       vocab_size=vocab or cfg.vocab_size, **kernels)
