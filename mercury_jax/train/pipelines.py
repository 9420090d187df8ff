"""The pipelines `mercury_jax.main` runs, by `config.pipeline`: "sft" (warm start), "sao" and "grpo" (pivot GRPO)."""
from __future__ import annotations

from pathlib import Path

import ml_collections

from mercury_jax.train.grpo import run_grpo
from mercury_jax.train.sao import run_sao
from mercury_jax.train.warm_start import run_sft_pipeline


def run_sao_pipeline(config: ml_collections.ConfigDict, workdir: str | Path):
    return run_sao(config, Path(workdir))


def run_grpo_pipeline(config: ml_collections.ConfigDict, workdir: str | Path):
    return run_grpo(config, Path(workdir))


PIPELINES = {"sft": run_sft_pipeline, "sao": run_sao_pipeline, "grpo": run_grpo_pipeline}
