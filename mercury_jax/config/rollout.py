"""The rollout side a config's `rollout` and `behaviour` sections name: episode budgets and sampling, the reward,
and the engine's settings on the rollout group's mesh (`rollout/settings.py` holds them as dataclasses)."""
from __future__ import annotations

import ml_collections

from mercury_jax.config.roles import rollout_layout
from mercury_jax.envs.behaviour import BehaviourConfig
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.rewards import EffectsReward, Reward
from mercury_jax.rollout.settings import Budgets, EngineSettings, EpisodeSettings, SamplingParams


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
