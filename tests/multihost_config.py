"""The `:tiny` configs shortened for the multi-process tests (tests/test_multihost_train.py), as a config file:

    python -m mercury_jax.main --config tests/multihost_config.py:sao --workdir DIR

8 devices split `per_process` (one process: all 8; two processes: 4 of each one's devices): rollout 4 (replicas of 2
devices, one on each process), actor 2 and critic 2 (one device on each process), so every group spans both processes.
Learner meshes of 2 devices: a sum over them adds the same two numbers in either process layout (over 4 devices the
in-process and the gloo all-reduce add in different orders: the same values to ~1e-6). Sync rollouts, no
more than a 3-step SFT warm start, a few short episodes a step.
"""
from __future__ import annotations

import ml_collections

from experiments import grpo, sao, sft


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg == "sft":
        return sft_config()
    if arg not in ("sao", "grpo"):
        raise ValueError(f"tests/multihost_config.py:{arg}: name 'sft', 'sao' or 'grpo'")
    c = sao.get_config("tiny") if arg == "sao" else grpo.get_config("tiny")
    # a 3-step SFT warm start (its own stage, checkpoints and resume) gives the learner non-zero gradients; GRPO
    # starts from the tiny preset (its KL term moves the weights from the second step on)
    c.sft.enabled = arg == "sao"
    c.sft.steps, c.sft.batch_rows, c.sft.row_length = 3, 4, 512
    c.sft.optimizer.warmup_steps = 0
    c.model.overrides.num_hidden_layers = 2  # one GDN + one attention layer: every code path, faster compiles
    c.device_layout = "per_process"
    c.rollout.replica = ml_collections.ConfigDict(dict(fsdp=2))  # one replica a process: half the compiles
    c.rollout.num_slots = 8
    c.rollout.max_tool_turns, c.rollout.max_turn_tokens = 2, 24
    c.checkpoint.async_save = True
    if arg == "sao":
        c.devices = ml_collections.ConfigDict(dict(rollout=4, actor=2, critic=2))
        c.world.num_train_tasks, c.world.num_eval_tasks = 64, 4
        c.sao.steps, c.sao.batch_prompts, c.sao.critic_only_steps = 5, 4, 1
        c.sao.eval_every = 0
        c.checkpoint.every = 3
    else:
        c.devices = ml_collections.ConfigDict(dict(rollout=4, actor=2))  # the reference: the actor's devices
        c.world.num_train_tasks = 64
        c.grpo.pivot_tasks = 16
        c.grpo.steps, c.grpo.batch_states, c.grpo.group_size = 3, 2, 4
        c.checkpoint.every = 2
    return c


def sft_config() -> ml_collections.ConfigDict:
    """The SFT stage alone on 8 devices, 4 of each process: an actor mesh of fsdp 4 x tensor 2, so a batch of 8 rows
    is 4 row blocks (data shards) of 2 rows, each block on the 2 tensor devices of one process."""
    c = sft.get_config("tiny")
    c.sft.steps, c.sft.batch_rows, c.sft.row_length, c.sft.log_every = 3, 8, 512, 1
    c.sft.optimizer.warmup_steps = 0
    c.model.overrides.num_hidden_layers = 2
    c.device_layout = "per_process"
    c.devices = ml_collections.ConfigDict(dict(actor=8))
    c.mesh.actor = ml_collections.ConfigDict(dict(data=1, fsdp=4, expert=1, tensor=2))
    c.checkpoint.async_save = True
    return c
