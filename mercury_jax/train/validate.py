"""Check a config before any work starts: known pipeline, required sections and fields, sane values.

Unknown fields are already rejected by the locked ConfigDict (`--config.typo=1` fails in the flag parser);
this adds the cross-field rules and names the field and the fix in each message.
"""
from __future__ import annotations

from pathlib import Path

import ml_collections

REQUIRED = {
    "sft": ("seed", "model", "tokenizer", "world", "sft", "checkpoint"),
    "sao": ("seed", "model", "tokenizer", "world", "sft", "sao", "rollout", "checkpoint", "devices"),
}


class ConfigError(ValueError):
    pass


def validate_config(config: ml_collections.ConfigDict) -> None:
    pipeline = config.get("pipeline")
    if pipeline not in REQUIRED:
        raise ConfigError(f"config.pipeline is {pipeline!r}; expected one of {sorted(REQUIRED)}")
    missing = [name for name in REQUIRED[pipeline] if name not in config]
    if missing:
        raise ConfigError(f"config for pipeline {pipeline!r} lacks {missing}; start from experiments/{pipeline}.py")
    model = config.model
    if not model.hf_path and not model.preset:
        raise ConfigError("set model.hf_path (an HF checkpoint directory) or model.preset (e.g. 'tiny')")
    if model.hf_path and not Path(model.hf_path).exists():
        raise ConfigError(f"model.hf_path {model.hf_path!r} does not exist; download the checkpoint there or pass "
                          f"--config.model.hf_path=/path/to/Qwen3.5-35B-A3B")
    if config.world.corpus_dir and not Path(config.world.corpus_dir).exists():
        raise ConfigError(f"world.corpus_dir {config.world.corpus_dir!r} does not exist; generate it with "
                          f"python -m mercury_jax.envs.generate --out DIR")
    if pipeline == "sao":
        _validate_sao(config)


def _validate_sao(config) -> None:
    import jax

    groups = dict(config.devices)
    total = sum(groups.values())
    if total == 0:
        groups = {name: 1 for name in groups}  # everything shares the default device
    elif min(groups.values()) == 0:
        raise ConfigError(f"config.devices {groups}: give every group a device count, or all 0 to share one")
    elif total > jax.device_count():
        raise ConfigError(f"config.devices {groups} needs {total} devices but {jax.device_count()} exist; shrink "
                          f"the groups (e.g. --config.devices.rollout=1)")
    for name in ("actor", "critic"):
        if config.sao.batch_prompts % groups[name]:
            raise ConfigError(f"sao.batch_prompts {config.sao.batch_prompts} is not divisible by the {groups[name]} "
                              f"{name} devices; change sao.batch_prompts or devices.{name}")
    if config.sao.group_size != 1:
        raise ConfigError("sao.group_size must be 1 (SAO uses one rollout per prompt); use experiments/grpo.py "
                          "for grouped rollouts")
    if not 0 < config.sao.eps_low < 1 or config.sao.eps_high <= 0:
        raise ConfigError(f"sao.eps_low must be in (0, 1) and sao.eps_high > 0, got {config.sao.eps_low}, "
                          f"{config.sao.eps_high}")
