"""Config pieces shared by the experiments (model, tokenizer, world, behaviour multiplier, checkpoints)."""
from __future__ import annotations

import dataclasses

import ml_collections

from mercury_jax.envs.behaviour import BehaviourConfig


def base_config(pipeline: str, arg: str | None) -> tuple[ml_collections.ConfigDict, bool]:
    """(config with pipeline, seed, model, tokenizer and world set, whether the variant is `tiny`)."""
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown variant {arg!r} of experiments/{pipeline}.py; use ':tiny' or nothing")
    tiny = arg == "tiny"
    c = ml_collections.ConfigDict()
    c.pipeline = pipeline
    c.seed = 0
    c.model = model_config(tiny)
    c.tokenizer = tokenizer_config(tiny)
    c.world = world_config(tiny)
    c.train = train_config()
    return c, tiny


def train_config() -> ml_collections.ConfigDict:
    """What every training loop does on a non-finite loss or gradient (mercury_jax/train/guards.py): "raise" stops
    the run naming the step; "skip" leaves the state as it was and goes on, at most `max_skipped` times a run."""
    return ml_collections.ConfigDict(dict(nonfinite="raise", max_skipped=10))


def model_config(tiny: bool) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.hf_path = "" if tiny else "/checkpoints/Qwen3.5-35B-A3B"  # an HF checkpoint directory (real runs)
    c.preset = "tiny" if tiny else ""                             # build from scratch instead (tiny demos)
    c.overrides = ml_collections.ConfigDict(
        dict(hidden_size=96, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24,
             linear_key_head_dim=24, linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
             moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2)
        if tiny else {})
    c.dtype = "float32" if tiny else "bfloat16"   # compute dtype; master weights are always fp32
    c.remat_policy = "none" if tiny else "dots_with_no_batch_dims_saveable"
    c.moe_impl = "dense" if tiny else "ragged"   # dense: plain matmuls over the 8 tiny experts (fast on CPU)
    return c


def tokenizer_config(tiny: bool) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.kind = "sentencepiece" if tiny else "qwen35"  # sentencepiece: trained on the world's oracle text
    c.vocab_size = 1024 if tiny else 0
    # Tiny: record ids (`T-3`), page ids (`p009`) and each distinct tool block of the system prompt are single tokens.
    c.atomic_pattern = r"\b[A-Z]-\d+\b|\bp\d{3}\b|# Tools\n[\s\S]*?do not mention functions\." if tiny else ""
    return c


def world_config(tiny: bool, name: str = "enterprise") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = name
    c.size = "tiny" if tiny else "full"
    c.corpus_dir = ""            # a corpus written by `python -m mercury_jax.envs.generate`; "" = generate in process
    c.train_seed = 0
    c.eval_seed = 10_000         # held-out tasks come from a disjoint seed range
    c.num_train_tasks = 1024 if tiny else 38_670
    c.num_eval_tasks = 64 if tiny else 512
    # tiny enterprise: 3, one per tiny template (two of them have one possible request per world; at 10 a world
    # fills up with the third and 76% of the tasks were deal-stage changes)
    c.tasks_per_world = 3 if tiny and name == "enterprise" else 10
    return c


def behaviour_config() -> ml_collections.ConfigDict:
    """The behaviour multiplier's strengths and thresholds (`mercury_jax.envs.behaviour.BehaviourConfig`)."""
    return ml_collections.ConfigDict(dataclasses.asdict(BehaviourConfig()))


def checkpoint_config(every: int, keep: int = 3) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(every=every, keep=keep, async_save=True))
