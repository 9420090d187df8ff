"""The wiring every RL pipeline shares, written once: the roles' meshes, the starting policy, the learner states,
the task stream, the rollout side (episodes and engine), the held-out evaluation, the checkpointer and metrics of
the loop. An algorithm supplies only what is its own: its learners and advantages, its batch assembly, its config
rules (`config/<name>_rules.py`) and its registry entry (`config/registry.py`: sections, roles, resume fields).

    run_pipeline(config, workdir, seams, Algorithm, cadence)
        = run_loop(Algorithm(Wiring(config, *starting_policy(config, run, mesh=meshes["actor"]), stage, seams,
                                    meshes=role_meshes(config, registry roles))), stage, cadence)

`Wiring` is what an algorithm's constructor receives; every method reads the config for the algorithm, so the config
enters the wiring once instead of each trainer calling `setup` piece by piece.
"""
from __future__ import annotations

import dataclasses
import os

import ml_collections
from flax import nnx

from mercury_jax.config.registry import pipeline
from mercury_jax.config.rollout import engine_settings, episode_settings
from mercury_jax.config.world import world_tasks
from mercury_jax.data.task_order import TaskOrder
from mercury_jax.rollout.settings import EpisodeSettings
from mercury_jax.runs.run_reader import eval_seed
from mercury_jax.runs.rundir import RunDir, StageDir
from mercury_jax.train.heldout import HeldOut
from mercury_jax.train.loop import Cadence, run_loop
from mercury_jax.train.placement import role_meshes, state_on_mesh
from mercury_jax.train.rollouts import Rollouts, Seams
from mercury_jax.train.state import TrainState
from mercury_jax.train.warm_start import starting_policy


@dataclasses.dataclass
class Wiring:
    """One run's shared parts: `model` (the starting policy, on `meshes["actor"]`) and `tokenizer`, the algorithm's
    `stage` directory, the caller's `seams`, and one mesh per role of the pipeline's registry entry."""
    config: ml_collections.ConfigDict
    model: nnx.Module
    tokenizer: object
    stage: StageDir
    seams: Seams = Seams()
    meshes: dict | None = None

    def __post_init__(self):
        if self.meshes is None:
            self.meshes = role_meshes(self.config, pipeline(self.stage.name).roles)

    def learner(self, model: nnx.Module, optimizer_cfg, role: str = "actor", trainable=nnx.Param) -> TrainState:
        """`model`'s trainable arrays and their optimiser state on `role`'s mesh."""
        return state_on_mesh(model, optimizer_cfg, self.meshes[role], trainable)

    def tasks(self, split: str) -> list:
        """The train or eval tasks: the seams' when given, else `config.world`'s."""
        return self.seams.tasks(split) if self.seams.tasks else world_tasks(self.config.world, split)

    def task_stream(self, tasks=None) -> TaskOrder:
        """The seeded epoch order over `tasks` (default: the train split), resumable by `consumed`."""
        return TaskOrder(self.tasks("train") if tasks is None else tasks, self.config.seed)

    def episodes(self, reward=None, seed: int | None = None) -> EpisodeSettings:
        """Episode settings of `config.rollout` with the run's seed; the reward is the seams', else `reward`, else
        the enterprise reward."""
        seed = self.config.seed if seed is None else seed
        return episode_settings(self.config, seed, reward=self.seams.reward or reward)

    def rollouts(self, episodes: EpisodeSettings | None = None, **kwargs) -> Rollouts:
        """The rollout side on the rollout mesh, with the starting policy's weights (`kwargs`: mode, staleness)."""
        engine = engine_settings(self.config, self.meshes["rollout"], self.seams.make_engine)
        return Rollouts(self.model, self.tokenizer, episodes or self.episodes(), engine, **kwargs)

    def heldout(self, rollouts: Rollouts, title: str) -> HeldOut:
        """Held-out evaluations on the eval split with their own seed stream (`eval_seed`), on `rollouts`' engine."""
        return HeldOut(rollouts, rollouts.evaluator(eval_seed(self.config)), self.tasks("eval"), self.stage,
                       title=title)


def run_pipeline(config: ml_collections.ConfigDict, workdir: str | os.PathLike, seams: Seams, algorithm_class,
                 cadence: Cadence):
    """Warm start (when `sft.enabled`), then `algorithm_class(Wiring(...))` run by the loop from its stage's latest
    checkpoint; returns (algorithm, metric history)."""
    run = RunDir(workdir)
    stage = run.stage(algorithm_class.stage)
    meshes = role_meshes(config, pipeline(algorithm_class.stage).roles)
    model, tokenizer = starting_policy(config, run, mesh=meshes["actor"])
    algorithm = algorithm_class(Wiring(config, model, tokenizer, stage, seams, meshes))
    history = run_loop(algorithm, stage, cadence, train_cfg=config.get("train"), rollouts=algorithm.rollouts,
                       make_checkpointer=seams.make_checkpointer)
    return algorithm, history
