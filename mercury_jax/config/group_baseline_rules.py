"""The group-baseline pipeline's config rules (registered in `registry.py`; `validate.py` runs them after the common
checks)."""
from __future__ import annotations

from mercury_jax.config.defaults import setting
from mercury_jax.config.validate import ConfigError, check_choice, check_micro_batches, role_row_shards
from mercury_jax.rl.losses import POLICY_LOSS_NAMES


def check_config(config) -> None:
    """The group-baseline rules: sync rollouts, groups of >= 2, a known policy loss, and a batch of B x K rows that
    the actor mesh splits into whole rows and micro-batches."""
    cfg = config.group_baseline
    if config.rollout.mode != "sync":
        raise ConfigError(f"rollout.mode is {config.rollout.mode!r}; the group-baseline pipeline learns from whole "
                          f"groups sampled with the latest weights: set rollout.mode='sync'")
    if cfg.group_size < 2:
        raise ConfigError(f"group_baseline.group_size is {cfg.group_size}; a group baseline needs >= 2 episodes "
                          f"of each task (8 released)")
    check_choice("group_baseline.policy_loss", setting(cfg, "policy_loss"), POLICY_LOSS_NAMES)
    rows = cfg.batch_prompts * cfg.group_size
    shards, sizes = role_row_shards(config, "actor")
    if rows % shards:
        raise ConfigError(f"group_baseline.batch_prompts x group_size = {rows} rows are not divisible by the "
                          f"{shards} row shards of the actor mesh {sizes}; change batch_prompts or mesh.actor")
    check_micro_batches("group_baseline.actor_micro_batches", setting(cfg, "actor_micro_batches"), rows, shards,
                        "group_baseline.batch_prompts x group_size", "actor")
