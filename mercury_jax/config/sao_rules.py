"""SAO's config rules (registered in `registry.py`; `validate.py` runs them after the common checks)."""
from __future__ import annotations

from mercury_jax.config.defaults import setting
from mercury_jax.config.validate import ConfigError, check_choice, check_micro_batches, role_row_shards
from mercury_jax.rl.losses import POLICY_LOSS_NAMES


def check_config(config) -> None:
    """SAO's rules: a known policy loss; each learner mesh splits `sao.batch_prompts` into whole rows and
    micro-batches."""
    check_choice("sao.policy_loss", setting(config.sao, "policy_loss"), POLICY_LOSS_NAMES)
    for name in ("actor", "critic"):
        shards, sizes = role_row_shards(config, name)
        if config.sao.batch_prompts % shards:
            raise ConfigError(f"sao.batch_prompts {config.sao.batch_prompts} is not divisible by the {shards} row "
                              f"shards of the {name} mesh {sizes} (data x fsdp x expert); change sao.batch_prompts "
                              f"or mesh.{name} / devices.{name}")
        check_micro_batches(f"sao.{name}_micro_batches", setting(config.sao, f"{name}_micro_batches"),
                             config.sao.batch_prompts, shards, "sao.batch_prompts", name)
