"""A fourth pipeline in ~50 lines, through the shared wiring (train/wiring.py) and `main`: REINFORCE on the tiny
enterprise world with the batch's mean reward as the baseline, A_i = R_i - mean_j R_j on every action token of
episode i, and SAO's actor step. This file is also the config file `main` reads (`get_config` registers it)."""
import numpy as np

from mercury_jax.config.registry import PIPELINES, RL_SECTIONS, Pipeline, register
from mercury_jax.parallel.distributed import fetch
from mercury_jax.rollout.trajectory import batch_trajectories, padded_length
from mercury_jax.train.loop import Cadence, StepResult
from mercury_jax.train.placement import batch_to_mesh
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.sao_learner import make_actor_step
from mercury_jax.train.wiring import run_pipeline


class Toy:
    stage, progress_keys, plot_keys = "toy", ("reward",), ("reward",)

    def __init__(self, wiring):
        self.cfg, self.config, self.pad_id = wiring.config.toy, wiring.config, wiring.tokenizer.pad_id
        self.steps, self.mesh = self.cfg.steps, wiring.meshes["actor"]
        self.actor = wiring.learner(wiring.model, self.cfg.actor_optimizer)
        self.actor_step = make_actor_step(self.actor.graphdef, self.actor.tx, self.cfg)
        self.stream, self.rollouts = wiring.task_stream(), wiring.rollouts()

    def arrays(self): return {"actor": self.actor.arrays()}
    def meta(self): return {"tasks_consumed": self.stream.consumed}
    def policy(self): return self.actor.model()

    def restore(self, arrays, meta):
        self.actor, self.stream.consumed = self.actor.replace_arrays(arrays["actor"]), meta["tasks_consumed"]

    def step(self, step, *, version, guard):
        trajectories, _, _ = self.rollouts.collect(self.stream, self.cfg.batch_prompts)
        length = padded_length(trajectories, self.config.rollout.max_total_tokens)
        batch = batch_trajectories(trajectories, length, pad_id=self.pad_id)
        del batch["rewards"], batch["lengths"]
        rewards = np.array([t.reward for t in trajectories], np.float32)
        batch["advantages"] = batch["action_mask"] * (rewards - rewards.mean())[:, None]
        a, batch = self.actor, batch_to_mesh(batch, self.mesh)
        a.params, a.opt_state, metrics = self.actor_step(a.params, a.frozen, a.opt_state, batch)
        applied = guard.check(step, fetch(metrics), what="actor update")
        return StepResult({"reward": float(rewards.mean())}, policy_updated=applied, applied=applied)


def run(config, workdir, seams=Seams()):
    return run_pipeline(config, workdir, seams, Toy, Cadence.from_config(config.checkpoint))


def get_config():
    from experiments.sao import get_config as sao_config
    if "toy" not in PIPELINES:
        register(Pipeline("toy", "toy_pipeline", RL_SECTIONS + ("toy",), roles=("rollout", "actor")))
    config = sao_config("tiny")
    config.pipeline, config.sft.enabled, config.toy = "toy", False, config.sao
    config.toy.steps, config.toy.batch_prompts = 2, 2
    del config.sao
    return config
