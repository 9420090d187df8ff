"""The pipelines `mercury_jax.main` runs, by `config.pipeline`: "sft" (warm start), "sao" and "grpo" (pivot GRPO).
Each takes (config, workdir) and an optional `rollouts.Seams`."""
from __future__ import annotations

from mercury_jax.train.grpo import run_grpo
from mercury_jax.train.sao import run_sao
from mercury_jax.train.warm_start import run_sft_pipeline

PIPELINES = {"sft": run_sft_pipeline, "sao": run_sao, "grpo": run_grpo}
