"""A tiny sync SAO run (6 train tasks, 2 a step: an epoch every 3 steps), importable and as the child process that
tests/test_data_resume.py SIGKILLs: `python tests/sao_resume_worker.py WORKDIR STEPS` (under pytest JAX's
compilation cache is the session's, JAX_COMPILATION_CACHE_DIR from tests/conftest.py, so the parent's later runs
reuse the child's compiles)."""
from __future__ import annotations

import sys

import jax

from experiments.sao import get_config
from mercury_jax.train.sao import run


def tiny_sao_config(steps: int):
    c = get_config("tiny")
    c.model.overrides.num_hidden_layers = 2  # one GDN + one attention layer: every code path, faster compiles
    c.sft.steps, c.sft.batch_rows, c.sft.log_every = 2, 4, 1
    s = c.sao
    s.steps, s.batch_prompts, s.critic_only_steps, s.eval_every = steps, 2, 1, 0
    c.rollout.num_slots, c.rollout.max_total_tokens = 4, 512
    c.rollout.max_turn_tokens, c.rollout.max_tool_turns = 32, 2
    c.world.num_train_tasks, c.world.num_eval_tasks = 6, 2
    c.checkpoint.every, c.checkpoint.keep = 1, 10
    return c


def run_tiny(workdir, steps: int):
    return run(tiny_sao_config(steps), workdir)


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py sets it for the parent
    run_tiny(sys.argv[1], int(sys.argv[2]))
