"""Config pieces shared by the experiments: model, tokenizer, world, behaviour multiplier, checkpoints, and the
`:tiny` overrides they have in common.

Each experiment builds the released run top to bottom, then applies its `:tiny` variant (a CPU demo from scratch)
as one block of overrides at the end (`tiny_common` here, then the experiment's own). Why a tiny value is what it is
is recorded in BENCHMARKS.md ("Tiny demo settings").
"""
from __future__ import annotations

import ml_collections

VARIANTS = (None, "", "tiny")


def is_tiny(pipeline: str, arg: str | None, variants: tuple = VARIANTS) -> bool:
    """Whether `arg` (the text after ':' in `--config experiments/X.py:ARG`) asks for the tiny variant; `variants`
    are the ones the experiment has."""
    if arg not in variants:
        named = " or ".join(f"':{v}'" for v in variants if v)
        raise ValueError(f"unknown variant {arg!r} of experiments/{pipeline}.py; use {named} or nothing")
    return arg == "tiny"


def base_config(pipeline: str, world: str = "enterprise") -> ml_collections.ConfigDict:
    """The released run's pipeline, seed, model, tokenizer, world and non-finite policy."""
    c = ml_collections.ConfigDict()
    c.pipeline = pipeline
    c.seed = 0
    c.model = model_config()
    c.tokenizer = tokenizer_config()
    c.world = world_config(world)
    c.train = train_config()
    # how config.devices' groups take devices (train/placement.py): "consecutive" slices of jax.devices() (on a pod,
    # whole hosts), or "per_process": each group takes its share of every process's devices
    c.device_layout = "consecutive"
    return c


def train_config() -> ml_collections.ConfigDict:
    """What every training loop does on a non-finite loss or gradient (mercury_jax/train/guards.py): "raise" stops
    the run naming the step; "skip" leaves the state as it was and goes on, at most `max_skipped` times a run."""
    return ml_collections.ConfigDict(dict(nonfinite="raise", max_skipped=10))


def model_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.hf_path = "/checkpoints/Qwen3.5-35B-A3B"  # an HF checkpoint directory
    c.preset = ""                               # or a preset of models/qwen35_moe/config.py, built from scratch
    c.overrides = ml_collections.ConfigDict({})  # HF config fields over the preset
    c.dtype = "bfloat16"                        # compute dtype; master weights are always fp32
    c.remat_policy = "full"                     # keeps 4 KiB a token a block (the dots policy: 160 KiB)
    c.moe_impl = "ep"                           # expert-parallel dispatch: the learner fits only so (BENCHMARKS)
    c.moe_ep_round_factor = 2.0                 # "ep": a dispatch round receives 2x the balanced load (moe_ep.py)
    c.attention_impl = "splash"                 # the Pallas TPU kernel; "blockwise" elsewhere, "dense" for tiny rows
    c.gdn_impl = "auto"                         # the Pallas kernel when tracing for TPU (per shard), else chunked
    return c


def tokenizer_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.kind = "qwen35"        # or "sentencepiece": trained on the world's oracle text (tiny models)
    c.vocab_size = 0         # sentencepiece only
    c.atomic_pattern = ""    # sentencepiece only: strings the pattern matches become single pieces
    return c


def world_config(name: str = "enterprise") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = name
    c.size = "full"
    c.corpus_dir = ""            # a corpus written by `python -m mercury_jax.envs.generate`; "" = generate in process
    c.train_seed = 0
    c.eval_seed = 10_000         # held-out tasks come from a disjoint seed range
    c.num_train_tasks = 38_670
    c.num_eval_tasks = 512
    c.tasks_per_world = 10
    return c


def behaviour_config() -> ml_collections.ConfigDict:
    """The behaviour multiplier's strengths and thresholds, the released values (the fields of
    `mercury_jax/envs/behaviour.py:BehaviourConfig`; docs/ENVIRONMENTS.md has what each factor does)."""
    return ml_collections.ConfigDict(dict(
        ngram=4, min_ngrams=8, repetition_threshold=0.3, repetition_strength=1.0,  # repeated word n-grams
        runaway_strength=0.5, runaway_chars=200,          # turns, calls and text after the final answer
        truncation_strength=0.5, truncation_in_think_strength=1.0,  # a budget stop (inside <think>: the whole)
        turn_budget_strength=0.5,                         # the tool-turn budget ran out before an answer
        collateral_strength=1.0,                          # per record the task said to leave alone that changed
        malformed_strength=0.0,                           # per format error; off (the tiny SAO demo sets 0.25)
    ))


def mesh_config(roles: tuple[str, ...], **sizes) -> ml_collections.ConfigDict:
    """The learner roles' meshes: axes (data, fsdp, sequence, expert, tensor) per role, one -1 taking the rest of the
    role's device group (mercury_jax/train/placement.py); `sizes` override the default fsdp over the whole group."""
    axes = dict(dict(data=1, fsdp=-1, sequence=1, expert=1, tensor=1), **sizes)
    return ml_collections.ConfigDict({role: dict(axes) for role in roles})


def checkpoint_config(every: int, keep: int = 3) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(every=every, keep=keep, async_save=True))


def tiny_common(c: ml_collections.ConfigDict) -> None:
    """The `:tiny` overrides every experiment shares: a ~10M-parameter model from scratch in fp32, a SentencePiece
    tokenizer trained on the tiny world's oracle text, the tiny world."""
    c.model.hf_path = ""
    c.model.preset = "tiny"
    c.model.overrides = ml_collections.ConfigDict(dict(
        hidden_size=96, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, linear_key_head_dim=24, linear_value_head_dim=24, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8,
        num_experts_per_tok=2))
    c.model.dtype = "float32"
    c.model.remat_policy = "none"
    c.model.moe_impl = "dense"   # plain matmuls over the 8 tiny experts: fastest on CPU
    c.model.attention_impl = "dense"  # [T, S] scores are small at tiny lengths
    c.model.gdn_impl = "chunked"      # pure JAX (the Pallas kernel would run interpreted on CPU)
    c.tokenizer.kind = "sentencepiece"
    c.tokenizer.vocab_size = 1024
    # record ids (`T-3`), page ids (`p009`) and each distinct tool block of the system prompt as single pieces
    c.tokenizer.atomic_pattern = r"\b[A-Z]-\d+\b|\bp\d{3}\b|# Tools\n[\s\S]*?do not mention functions\."
    c.world.size = "tiny"
    c.world.num_train_tasks = 1024
    c.world.num_eval_tasks = 64
    if c.world.name == "enterprise":
        c.world.tasks_per_world = 3   # one per tiny template
