"""Build what every pipeline needs from its config: tasks, tokenizer, model, device groups."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grain
import jax.numpy as jnp
import ml_collections
from flax import nnx

from mercury_jax.chat import qwen35_tokenizer, train_sentencepiece_tokenizer
from mercury_jax.envs.behaviour import BehaviourConfig
from mercury_jax.envs.episode import make_episode, oracle_trajectory
from mercury_jax.envs.generate import TaskSource
from mercury_jax.envs.presets import preset_tasks
from mercury_jax.parallel import init_sharded
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.rewards import EffectsReward, Reward
from mercury_jax.rollout.settings import Budgets, EngineSettings, EpisodeSettings, SamplingParams
from mercury_jax.train.config_defaults import setting
from mercury_jax.train.rundir import RunDir
from models.qwen35_moe import Qwen35MoeForCausalLM, load_hf
from models.qwen35_moe.config import PRESETS


def world_tasks(world: ml_collections.ConfigDict, split: str) -> list[dict]:
    """Train or eval tasks: from the corpus directory if set, else generated in process (disjoint seeds). A corpus's
    train split is a lazy grain source (records n_eval .. n_eval + num_train_tasks, read when a run reaches them, so
    each host of a pod reads only its own episodes' tasks); the eval split is a list."""
    if world.corpus_dir:
        source = TaskSource(world.corpus_dir)
        n_eval = world.num_eval_tasks
        if split == "train":
            return grain.MapDataset.source(source).slice(slice(n_eval, n_eval + world.num_train_tasks))
        return [source[i] for i in range(min(n_eval, len(source)))]
    seed, count = ((world.train_seed, world.num_train_tasks) if split == "train"
                   else (world.eval_seed, world.num_eval_tasks))
    tasks: list[dict] = []
    for world_seed in range(seed, seed + 100 * count):  # one seed is one company with a few distinct tasks
        tasks += preset_tasks(world.name, world.size, world_seed, min(world.tasks_per_world, count - len(tasks)))
        if len(tasks) >= count:
            return tasks
    raise ValueError(f"could not generate {count} {world.name} tasks; lower world.num_{split}_tasks")


def tool_schemas(tasks: list[dict]) -> list[list[dict]]:
    """The OpenAI-style tool schemas each task's episode offers (as the rollout renders them)."""
    async def one(task):
        async with make_episode(task) as episode:
            return await episode.tools()

    async def all_tasks():
        return [await one(task) for task in tasks]

    return asyncio.run(all_tasks())


def oracle_messages(tasks: list[dict], options: dict | None = None) -> list[list[dict]]:
    """The scripted solver's chats; `options` set the browsing oracle's `OracleConfig` (e.g. over_search_prob)."""
    return [oracle_trajectory(task, **(options or {})) for task in tasks]


def build_tokenizer(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike | RunDir, corpus_texts: list[str]):
    """The Qwen3.5 BPE, or a SentencePiece model trained (deterministically, cached in the run's `tokenizer/`) on
    `corpus_texts`. SentencePiece reads local files only: a remote run directory gets a copy of the model trained
    in a local cache."""
    if cfg.kind == "qwen35":
        return qwen35_tokenizer()
    if cfg.kind == "sentencepiece":
        run = workdir if isinstance(workdir, RunDir) else RunDir(workdir)
        cache = run.tokenizer if run.local else Path.home() / ".cache" / "mercury_jax" / "tokenizer"
        tokenizer = train_sentencepiece_tokenizer(corpus_texts, vocab_size=cfg.vocab_size,
                                                  cache_dir=Path(os.fspath(cache)),
                                                  atomic_pattern=setting(cfg, "atomic_pattern"))
        if not run.local:
            run.tokenizer.mkdir(parents=True, exist_ok=True)
            (run.tokenizer / tokenizer.model_file.name).write_bytes(tokenizer.model_file.read_bytes())
        return tokenizer
    raise ValueError(f"tokenizer.kind {cfg.kind!r} is not 'qwen35' or 'sentencepiece'")


RUNTIME_FIELDS = ("dtype", "remat_policy", "moe_impl", "moe_ep_round_factor", "attention_impl", "gdn_impl")


def model_runtime(cfg: ml_collections.ConfigDict) -> dict:
    """The model config fields a run sets (`RUNTIME_FIELDS`: compute dtype and implementations) from its `model`
    section; a field the section lacks (an older run's config.json) keeps the model's default."""
    return {name: cfg[name] for name in RUNTIME_FIELDS if name in cfg}


def preset_config(cfg: ml_collections.ConfigDict, vocab_size: int, preset: str = ""):
    """The model config of a run built from a preset (`cfg.preset`, or `preset` for shapes alone) with the run's
    runtime fields; the `tiny` preset takes `cfg.overrides` and the tokenizer's vocabulary rounded up to 64."""
    name = preset or cfg.preset
    if name not in PRESETS:
        raise ValueError(f"model.preset {name!r} is not one of {sorted(PRESETS)}")
    runtime = model_runtime(cfg)
    if name == "tiny":
        return PRESETS["tiny"](vocab_size=-(-vocab_size // 64) * 64, **runtime, **cfg.overrides.to_dict())
    return PRESETS[name](**runtime)


def build_model(cfg: ml_collections.ConfigDict, vocab_size: int, seed: int, *, mesh=None) -> Qwen35MoeForCausalLM:
    """From an HF checkpoint (`hf_path`) or from scratch (`preset` + `overrides`), fp32 master weights. With a
    `mesh`, created straight into its sharding there: a checkpoint tensor by tensor (`load_hf(mesh=)`), a preset
    by abstract shapes and a sharded jitted init (`parallel.init_sharded`: an eager init's values to an fp32 ulp;
    a one-device mesh keeps the eager init, so the tiny demos reproduce their recorded runs bit for bit)."""
    if cfg.hf_path:
        if not Path(cfg.hf_path).exists():
            raise FileNotFoundError(f"model.hf_path {cfg.hf_path} does not exist; point it at an HF checkpoint "
                                    f"directory or set model.hf_path='' and model.preset='tiny'")
        runtime = model_runtime(cfg)
        return load_hf(cfg.hf_path, dtype=jnp.float32, compute_dtype=runtime.pop("dtype"), mesh=mesh, **runtime)
    model_cfg = preset_config(cfg, vocab_size)
    def make():
        return Qwen35MoeForCausalLM(model_cfg, rngs=nnx.Rngs(seed))
    if mesh is None or mesh.size == 1:  # one device holds it whole anyway: the eager init's exact values
        return make()
    return init_sharded(make, mesh)


def rollout_budgets(rollout: ml_collections.ConfigDict) -> Budgets:
    """The episode budgets of a config's `rollout` section."""
    return Budgets(max_tool_turns=rollout.max_tool_turns, max_total_tokens=rollout.max_total_tokens,
                   max_turn_tokens=rollout.max_turn_tokens)


def episode_settings(config: ml_collections.ConfigDict, seed: int, *, reward: Reward | None = None) -> EpisodeSettings:
    """The episodes of a run's config: its `rollout` budgets and sampling with the stream's `seed`, the worlds'
    environments, and `reward` (default: the enterprise reward with `config.behaviour`)."""
    rollout = config.rollout
    return EpisodeSettings(budgets=rollout_budgets(rollout),
                           sampling=SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, seed=seed),
                           reward=reward if reward is not None else episode_reward(config))


def engine_settings(config: ml_collections.ConfigDict, mesh, make_engine=Engine) -> EngineSettings:
    """The rollout engine of a run's config on the rollout group's `mesh`: `rollout.num_slots` slots over its
    devices, replica meshes of shape `rollout.replica` (empty: one engine), weights in `rollout.param_dtype`
    ("": the learner's)."""
    rollout, devices = config.rollout, list(mesh.devices.flat)
    replica, param_dtype = rollout_layout(rollout)
    return EngineSettings(num_slots=rollout.num_slots, max_length=rollout.max_total_tokens, devices=devices,
                          replicas=replica_meshes(devices, replica) if replica else None, param_dtype=param_dtype,
                          make_engine=make_engine)


def rollout_layout(rollout: ml_collections.ConfigDict | None) -> tuple[dict, str | None]:
    """(one replica's mesh shape, {} for a single engine; the rollout weights' dtype, None for the learner's) of a
    config's `rollout` section (None: no section)."""
    return dict(setting(rollout, "replica") or {}), setting(rollout, "param_dtype") or None


def episode_reward(config: ml_collections.ConfigDict) -> EffectsReward:
    """The enterprise episodes' reward: effects fraction x the behaviour multiplier of `config.behaviour`."""
    return EffectsReward(behaviour(config))


def behaviour(config: ml_collections.ConfigDict):
    """The behaviour multiplier's settings from `config.behaviour` (the defaults where a run's config predates
    the section)."""
    return BehaviourConfig(**config.behaviour.to_dict()) if "behaviour" in config else BehaviourConfig()
