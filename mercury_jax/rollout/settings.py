"""The rollout's settings, passed whole: what every episode of a runner shares (`EpisodeSettings`) and how its
engine is built and where it runs (`EngineSettings`). A trainer builds both once from its config
(`config/rollout.py`); the runner, the worker, the replicas and the trainers' `Rollouts` take them as they are."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from mercury_jax.envs import make_episode
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.rewards import EffectsReward, Reward


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Per-episode limits. `max_turn_tokens` None: a turn may use whatever is left of `max_total_tokens`."""
    max_tool_turns: int = 20
    max_total_tokens: int = 24576
    max_turn_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class EnvLimits:
    """How long an environment may take and how much it may say: `call_timeout_s` (one tool call),
    `connect_timeout_s` (building the world, MCP connect and tools/list; None: the environment's default),
    `max_result_chars` (one observation; None: the environment's default), `grade_timeout_s` (grading, judge
    included); `judge` the grader's LLM judge (None: the environment's default)."""
    call_timeout_s: float = 30.0
    connect_timeout_s: float | None = None
    max_result_chars: int | None = None
    grade_timeout_s: float = 300.0
    judge: Any = None

    def episode_options(self) -> dict:
        """The keyword options an environment factory takes (the unset ones left to its defaults)."""
        options = {"call_timeout_s": self.call_timeout_s}
        for name in ("connect_timeout_s", "max_result_chars", "judge"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    """What every episode of a runner shares. `environment(task, **limits.episode_options())` opens a task's
    environment, which also builds its prompt (`envs/episode.py`); `reward(task, trajectory, grade) -> (reward,
    parts)` scores a finished episode (None: `EffectsReward` with the default behaviour multiplier)."""
    budgets: Budgets = Budgets()
    sampling: SamplingParams = SamplingParams()
    reward: Reward | None = None
    environment: Callable[..., Any] = make_episode
    limits: EnvLimits = EnvLimits()
    enable_thinking: bool = True

    def scorer(self) -> Reward:
        return self.reward if self.reward is not None else EffectsReward()

    def with_seed(self, seed: int) -> EpisodeSettings:
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, seed=seed))


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How a rollout engine is built and where it runs: `num_slots` sequences at once (split evenly over the
    replicas), each up to `max_length` tokens (None: the episodes' `max_total_tokens`), `steps_per_sync` decode
    steps a chunk. With `replicas` (meshes, `layout.replica_meshes`) a `ReplicatedEngine`, its weights cast to
    `param_dtype` (None: the learner's) and sized against `hbm_gib` (None: the device's); else one engine, its
    weights replicated over `devices` (None: where the model is). `make_engine` builds each engine (tests inject a
    scripted one)."""
    num_slots: int = 8
    max_length: int | None = None
    steps_per_sync: int = 8
    replicas: Sequence | None = None
    devices: Sequence | None = None
    param_dtype: Any = None
    hbm_gib: float | None = None
    make_engine: Callable = Engine

    def length(self, budgets: Budgets) -> int:
        return self.max_length or budgets.max_total_tokens
