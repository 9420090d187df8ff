"""Pivot GRPO's config rules (registered in `registry.py`; `validate.py` runs them after the common checks)."""
from __future__ import annotations

from pathlib import Path

from mercury_jax.config.defaults import setting
from mercury_jax.config.validate import ConfigError, check_micro_batches, role_row_shards
from mercury_jax.envs.browse.stop_verifier import STOP_RULES
from mercury_jax.rl.aggregation import LOSS_AGG_MODES

PIVOT_SOURCES = ("policy", "oracle")  # grpo.pivot_source: the warm-started policy's episodes, or the oracle's




def check_config(config) -> None:
    """Pivot GRPO's rules: the browsing world, batch rows that split into minibatches, micro-batches and every
    mesh's row shards, known estimators, aggregations, pivot sources and stop rules."""
    g, rollout = config.grpo, config.rollout
    if config.world.name != "browse":
        raise ConfigError(f"world.name is {config.world.name!r}; pivot GRPO trains on browsing states, set "
                          f"world.name='browse'")
    rows = g.batch_states * g.group_size
    if g.pack_rows and g.minibatches > 1:
        raise ConfigError(f"grpo.pack_rows packs the whole batch into the first micro-batches, but grpo.minibatches "
                          f"= {g.minibatches} would deal its packed rows into separate optimiser steps; set "
                          f"grpo.minibatches=1 or grpo.pack_rows=False")
    if rows % g.minibatches:
        raise ConfigError(f"grpo.batch_states x grpo.group_size = {rows} rows do not split into {g.minibatches} "
                          f"equal minibatches; change grpo.minibatches")
    shards, sizes = role_row_shards(config, "actor")
    if (rows // g.minibatches) % shards:
        raise ConfigError(f"a minibatch of {rows // g.minibatches} rows (grpo.batch_states x grpo.group_size / "
                          f"grpo.minibatches) is not divisible by the {shards} row shards of the actor mesh {sizes} "
                          f"(data x fsdp x expert); change grpo.batch_states or mesh.actor / devices.actor")
    check_micro_batches("grpo.micro_batches", setting(g, "micro_batches"), rows // g.minibatches, shards,
                         "grpo.batch_states x grpo.group_size / grpo.minibatches", "actor")
    shards, sizes = role_row_shards(config, "reference")
    if rows % shards:
        raise ConfigError(f"grpo.batch_states x grpo.group_size = {rows} rows are not divisible by the {shards} row "
                          f"shards of the reference mesh {sizes} (on the actor's devices); change mesh.reference")
    if g.kl_estimator not in ("k1", "k2", "k3"):
        raise ConfigError(f"grpo.kl_estimator {g.kl_estimator!r} is not one of k1, k2, k3")
    if g.loss_agg not in LOSS_AGG_MODES:
        raise ConfigError(f"grpo.loss_agg {g.loss_agg!r} is not one of {LOSS_AGG_MODES}")
    if g.pivot_source not in PIVOT_SOURCES:
        raise ConfigError(f"grpo.pivot_source {g.pivot_source!r} is not one of {PIVOT_SOURCES}")
    unknown = set(g.stop_rules) - set(STOP_RULES)
    if unknown:
        raise ConfigError(f"grpo.stop_rules has unknown outcomes {sorted(unknown)}; known: {sorted(STOP_RULES)}")
    if g.pivots_path and not Path(g.pivots_path).exists() and not Path(g.pivots_path).parent.exists():
        raise ConfigError(f"grpo.pivots_path {g.pivots_path!r} does not exist and neither does its directory (the "
                          f"dataset is built there when missing); create the directory or pass "
                          f"--config.grpo.pivots_path='' to build it into the workdir")
    if rollout.max_turn_tokens >= rollout.max_total_tokens:
        raise ConfigError(f"rollout.max_turn_tokens {rollout.max_turn_tokens} must be below rollout.max_total_tokens "
                          f"= {rollout.max_total_tokens} (a continuation leaves room for its prompt)")
    if not config.sft.enabled and not config.model.hf_path:
        print("[grpo] warning: sft.enabled is False and model.hf_path is empty: GRPO starts from an untrained "
              "model", flush=True)
