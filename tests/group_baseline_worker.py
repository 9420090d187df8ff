"""The tiny group-baseline run of tests/test_train_group_baseline.py, importable and as the child process that the
kill test SIGKILLs: `python tests/group_baseline_worker.py WORKDIR STEPS` (under pytest JAX's compilation cache is
the session's, JAX_COMPILATION_CACHE_DIR from tests/conftest.py, so the parent's later runs reuse the child's
compiles)."""
from __future__ import annotations

import sys

import jax

from experiments.group_baseline import get_config
from mercury_jax.config.rollout import episode_reward
from mercury_jax.train.group_baseline import run
from mercury_jax.train.rollouts import Seams

GROUP_SIZE = 4


def tiny_group_config(steps: int):
    """2 tasks x 4 episodes a step on 4 rollout and 4 actor devices, a checkpoint every step."""
    c = get_config("tiny")
    c.model.overrides.num_hidden_layers = 2  # one GDN + one attention layer: every code path, faster compiles
    c.sft.steps, c.sft.batch_rows, c.sft.log_every = 2, 4, 1
    g = c.group_baseline
    g.steps, g.batch_prompts, g.group_size, g.eval_every = steps, 2, GROUP_SIZE, 0
    c.rollout.num_slots, c.rollout.max_total_tokens = 8, 512
    c.rollout.max_turn_tokens, c.rollout.max_tool_turns = 32, 2
    c.world.num_train_tasks, c.world.num_eval_tasks = 6, 2
    c.checkpoint.every, c.checkpoint.keep = 1, 10
    c.devices.rollout, c.devices.actor = 4, 4
    return c


def synthetic_reward(config):
    """The run's own reward parts with a deterministic score of the sampled tokens in [0, 1] as the reward: the
    tiny policy after 2 SFT steps earns 0 on every task, which would make every advantage 0."""
    real = episode_reward(config)

    def reward(task, trajectory, grade):
        actions = [tok for tok, m in zip(trajectory.tokens, trajectory.action_mask) if m]
        return (sum(actions) % 11) / 10.0, real(task, trajectory, grade)[1]
    return reward


def run_tiny(workdir, steps: int):
    config = tiny_group_config(steps)
    return run(config, workdir, Seams(reward=synthetic_reward(config)))


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py sets it for the parent
    run_tiny(sys.argv[1], int(sys.argv[2]))
