"""Build what every pipeline needs from its config: tasks, tokenizer, model, device groups."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grain
import ml_collections

from mercury_jax.chat import qwen35_tokenizer, train_sentencepiece_tokenizer
from mercury_jax.config.defaults import setting
from mercury_jax.config.roles import rollout_layout
from mercury_jax.envs.behaviour import BehaviourConfig
from mercury_jax.envs.episode import make_episode, oracle_trajectory
from mercury_jax.envs.generate import TaskSource
from mercury_jax.envs.presets import preset_tasks
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.rewards import EffectsReward, Reward
from mercury_jax.rollout.settings import Budgets, EngineSettings, EpisodeSettings, SamplingParams
from mercury_jax.runs.rundir import RunDir


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

def episode_reward(config: ml_collections.ConfigDict) -> EffectsReward:
    """The enterprise episodes' reward: effects fraction x the behaviour multiplier of `config.behaviour`."""
    return EffectsReward(behaviour(config))


def behaviour(config: ml_collections.ConfigDict):
    """The behaviour multiplier's settings from `config.behaviour` (the defaults where a run's config predates
    the section)."""
    return BehaviourConfig(**config.behaviour.to_dict()) if "behaviour" in config else BehaviourConfig()
