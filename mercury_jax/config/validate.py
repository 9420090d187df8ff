"""Check a config before any work starts: known pipeline, required sections and fields, sane values.

Unknown fields are already rejected by the locked ConfigDict (`--config.typo=1` fails in the flag parser). This
checks every numeric field's type and range (the table in `ranges.py`), the model a preset and its
overrides make (the model config's own table), then the rules between fields, naming the field and the fix in
each message.
"""
from __future__ import annotations

import math
from pathlib import Path

import jax
import ml_collections

from mercury_jax.config.defaults import setting
from mercury_jax.config.model import model_runtime
from mercury_jax.config.ranges import field_problem
from mercury_jax.config.registry import PIPELINES
from mercury_jax.config.roles import DEVICE_LAYOUTS, role_devices, role_mesh_sizes, rollout_layout, row_shards
from mercury_jax.data.corpus import corpus_files
from mercury_jax.parallel import MESH_AXES
from models.qwen35_moe.config import ATTENTION_IMPLS, GDN_IMPLS, MOE_IMPLS, PRESETS, REMAT_POLICIES, field_problems

NONFINITE_POLICIES = ("raise", "skip")  # train.nonfinite: stop at a non-finite update, or skip it (train/guards.py)


class ConfigError(ValueError):
    pass


def nonfinite_problem(policy, max_skipped) -> str:
    """What is wrong with a `train` section's non-finite policy ("" when nothing)."""
    if policy not in NONFINITE_POLICIES:
        return (f"train.nonfinite is {policy!r}; use one of {NONFINITE_POLICIES} ('raise' stops at the first "
                f"non-finite step, 'skip' skips up to train.max_skipped of them)")
    if max_skipped < 0:
        return f"train.max_skipped is {max_skipped}; use a count >= 0"
    return ""


def validate_config(config: ml_collections.ConfigDict) -> None:
    pipeline = config.get("pipeline")
    if pipeline not in PIPELINES:
        raise ConfigError(f"config.pipeline is {pipeline!r}; expected one of {sorted(PIPELINES)}")
    missing = [name for name in PIPELINES[pipeline].sections if name not in config]
    if missing:
        raise ConfigError(f"config for pipeline {pipeline!r} lacks {missing}; start from experiments/{pipeline}.py")
    problem = field_problem(config)  # before any rule below computes with a field
    if problem:
        raise ConfigError(problem)
    model = config.model
    if not model.hf_path and not model.preset:
        raise ConfigError("set model.hf_path (an HF checkpoint directory) or model.preset (e.g. 'tiny')")
    if model.hf_path and not Path(model.hf_path).exists():
        raise ConfigError(f"model.hf_path {model.hf_path!r} does not exist; download the checkpoint there or pass "
                          f"--config.model.hf_path=/path/to/Qwen3.5-35B-A3B")
    if config.world.corpus_dir and not Path(config.world.corpus_dir).exists():
        raise ConfigError(f"world.corpus_dir {config.world.corpus_dir!r} does not exist; generate it with "
                          f"python -m mercury_jax.envs.generate --out DIR")
    _validate_model_runtime(model)
    if not model.hf_path:  # a checkpoint's config.json is checked by load_hf
        _validate_preset_model(model)
    if "devices" in config:
        _check_device_groups(config)
    if "devices" in config and "mesh" in config:
        _check_sequence_axes(config, pipeline)
    if pipeline == "sft" or config.sft.enabled:  # the warm start trains on the actor's mesh
        shards = role_row_shards(config, "actor")[0] if "devices" in config else 1
        if config.sft.batch_rows % shards:
            raise ConfigError(f"sft.batch_rows {config.sft.batch_rows} is not divisible by the {shards} row shards "
                              f"of the actor mesh; change sft.batch_rows or mesh.actor / devices.actor")
        check_micro_batches("sft.micro_batches", setting(config.sft, "micro_batches"), config.sft.batch_rows, shards,
                             "sft.batch_rows", "actor")
        if setting(config.sft, "data"):
            try:
                corpus_files(config.sft.data)
            except FileNotFoundError as error:
                raise ConfigError(str(error)) from None
    if "train" in config:
        problem = nonfinite_problem(setting(config.train, "nonfinite"), setting(config.train, "max_skipped"))
        if problem:
            raise ConfigError(problem)
    PIPELINES[pipeline].check(config)  # the pipeline's own rules (its module's check_config)


def check_choice(field: str, value, allowed) -> None:
    """`value` of `field` must be one of `allowed`."""
    if value not in allowed:
        raise ConfigError(f"{field} is {value!r}; use one of {sorted(allowed)}")


def check_micro_batches(field: str, micro_batches, rows: int, shards: int, rows_field: str, group: str) -> None:
    """A learner step's micro-batches split each data shard's rows into equal whole parts (train/microbatch.py):
    `micro_batches` must divide rows / shards."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(f"{field} is {micro_batches!r}; use a whole number >= 1 (1: the whole batch in one pass)")
    per_shard = rows // shards
    if per_shard % micro_batches:
        fits = [d for d in range(1, per_shard + 1) if per_shard % d == 0]
        raise ConfigError(f"{field} = {micro_batches} does not divide the {per_shard} rows per data shard "
                          f"({rows_field} = {rows} rows over the {shards} row shard(s) of the {group} mesh); set "
                          f"{field} to one of {fits}, or change {rows_field}")


def _validate_model_runtime(model) -> None:
    for field, allowed in (("remat_policy", REMAT_POLICIES), ("moe_impl", MOE_IMPLS),
                           ("attention_impl", ATTENTION_IMPLS), ("gdn_impl", GDN_IMPLS)):
        if field in model and model[field] not in allowed:
            raise ConfigError(f"model.{field} is {model[field]!r}; use one of {list(allowed)}")
    if model.get("attention_impl") == "splash" and jax.default_backend() != "tpu":
        raise ConfigError(f"model.attention_impl 'splash' is the Pallas TPU kernel and this backend is "
                          f"{jax.default_backend()!r}; pass --config.model.attention_impl=blockwise (the same "
                          f"attention without [T, S] scores, pure JAX) or 'dense'")


def _validate_preset_model(model) -> None:
    """The model `model.preset` and `model.overrides` make (no weights): each override's type and range, then the
    model config's rules between fields (heads that divide, experts per token <= experts, ...)."""
    if model.preset not in PRESETS:
        raise ConfigError(f"model.preset is {model.preset!r}; use one of {sorted(PRESETS)} (or set model.hf_path)")
    overrides = model.get("overrides") or ml_collections.ConfigDict()
    if model.preset != "tiny":  # config/model.py preset_config: only the tiny preset takes overrides
        overrides = ml_collections.ConfigDict()
    problems = field_problems(overrides)
    if problems:
        raise ConfigError("; ".join(f"model.overrides.{problem}" for problem in problems))
    try:
        PRESETS[model.preset](**model_runtime(model), **overrides.to_dict())
    except (TypeError, ValueError) as error:
        raise ConfigError(f"model.preset {model.preset!r} with model.overrides {overrides.to_dict()} is not a valid "
                          f"model: {str(error).removeprefix('invalid Qwen35MoeConfig: ')}") from None


def _check_device_groups(config) -> None:
    groups = dict(config.devices)
    total = sum(groups.values())
    if total and min(groups.values()) == 0:
        raise ConfigError(f"config.devices {groups}: give every group a device count, or all 0 to share one")
    if total > jax.device_count():
        raise ConfigError(f"config.devices {groups} needs {total} devices but {jax.device_count()} exist; shrink "
                          f"the groups (e.g. --config.devices.rollout=1)")
    layout = setting(config, "device_layout")
    if layout not in DEVICE_LAYOUTS:
        raise ConfigError(f"device_layout {layout!r} is not one of {DEVICE_LAYOUTS}")
    if layout == "per_process" and total and any(size % jax.process_count() for size in groups.values()):
        raise ConfigError(f"device_layout 'per_process' splits every group over the {jax.process_count()} processes: "
                          f"config.devices {groups} has a group that is not a multiple of {jax.process_count()}")
    _check_rollout_replicas(config)


def _check_rollout_replicas(config) -> None:
    """`rollout.replica` (one replica's mesh shape; empty: one engine) must split the rollout group evenly, and
    `rollout.num_slots` must split evenly over the replicas."""
    rollout = config.get("rollout")
    replica = rollout_layout(rollout)[0]
    if not replica:
        return
    unknown = set(replica) - set(MESH_AXES)
    if unknown or any(not isinstance(s, int) or s < 1 for s in replica.values()):
        raise ConfigError(f"rollout.replica {replica}: name axes of {MESH_AXES} with sizes >= 1 (no -1)")
    size, group = math.prod(replica.values()), role_devices(config, "rollout")
    if group % size:
        raise ConfigError(f"rollout.replica {replica} ({size} devices) does not divide the rollout group of {group} "
                          f"device(s); pick a replica size that divides devices.rollout")
    replicas = group // size
    if rollout.num_slots % replicas:
        raise ConfigError(f"rollout.num_slots {rollout.num_slots} does not split over {replicas} replicas "
                          f"({group} rollout devices / {size} per replica); make it a multiple of {replicas}")


def _check_sequence_axes(config, pipeline: str) -> None:
    """A role whose mesh splits rows over 'sequence' (n chips, models/qwen35_moe/row_split.py) needs rows of a
    multiple of 2n positions: SFT rows of `sft.row_length`, RL rows padded to 128- or 2,048-token buckets
    (`trajectory.padded_length`)."""
    for role in config.mesh:
        n = role_row_shards(config, role)[1].get("sequence", 1)
        if n == 1:
            continue
        lengths = []
        if role == "actor" and (pipeline == "sft" or config.sft.get("enabled", False)):
            lengths.append(("sft.row_length", config.sft.row_length))
        if "rollout" in config and pipeline != "sft":
            limit = config.rollout.max_total_tokens
            lengths.append(("the learner's padding bucket", 128 if limit <= 4096 else 2048))
        for name, length in lengths:
            if length % (2 * n) or length // (2 * n) < 3:
                raise ConfigError(f"mesh.{role}.sequence = {n} splits each row into {2 * n} spans, but {name} is "
                                  f"{length}: rows must be a multiple of {2 * n} positions, spans at least 3 (the "
                                  f"conv window); lower mesh.{role}.sequence or change {name}")


def role_row_shards(config, role: str) -> tuple[int, dict]:
    """(how many ways `role`'s mesh splits a batch's rows, its axis sizes); ConfigError when the mesh does not fit."""
    try:
        sizes = role_mesh_sizes(config, role)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return row_shards(sizes), sizes
