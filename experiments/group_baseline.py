"""Group-baseline RL: K episodes per task, the group's mean reward as the baseline on every generated token, a
barrier before learning, SAO's policy loss, no critic. The algorithm of the rest of the model family, on SAO's world,
reward and losses: what SAO is measured against (`python -m mercury_jax.bench.sao_vs_group`).

The default is the released-size run, matched to experiments/sao.py: 16 tasks x 8 episodes = SAO's 128 episodes a
step, the same actor optimiser and loss, the same 128 chips and rollout layout (SAO's critic chips go to the actor,
so the learners get the same 64 chips):

    python -m mercury_jax.main --config experiments/group_baseline.py --workdir gs://bucket/group \
        --config.model.hf_path=/ckpt/Qwen3.5-35B-A3B --config.world.corpus_dir=/data/enterprise

`:tiny` runs on one CPU from scratch, matched to experiments/sao.py:tiny (the same warm start, 2 x 8 = 16 episodes
a step, 80 steps, the same actor settings):

    python -m mercury_jax.main --config experiments/group_baseline.py:tiny
"""
from __future__ import annotations

import ml_collections

from experiments import common
from experiments.sft import sft_config, tiny_sft


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    tiny = common.is_tiny("group_baseline", arg)
    c = common.base_config("group_baseline")
    c.sft = sft_config()
    c.sft.enabled = False         # the released run starts from an HF checkpoint
    c.checkpoint = common.checkpoint_config(every=10)

    g = ml_collections.ConfigDict()
    g.steps = 159
    g.batch_prompts = 16          # tasks a step
    g.group_size = 8              # episodes of each task (the family's K)
    g.std_normalize = True        # A = (R - mean) / (std + 1e-6); False: A = R - mean
    g.filter_zero_variance = False  # all-equal groups have A = 0 anyway; True also drops their rows
    g.policy_loss = "dis"         # SAO's decoupled trust-region loss ("ppo": the clipped surrogate)
    g.eps_low = 0.2
    g.eps_high = 0.28
    g.loss_agg = "token-mean"
    g.actor_micro_batches = 2     # 128 rows over 64 actor chips, one row per chip at a time (as SAO's actor)
    g.pack_rows = True
    g.actor_optimizer = ml_collections.ConfigDict(dict(lr=1e-6, warmup_steps=0, b1=0.9, b2=0.98, eps=1e-8,
                                                       weight_decay=0.0, grad_clip=0.0))
    g.eval_every = 20
    g.log_window = 20
    c.group_baseline = g

    r = ml_collections.ConfigDict()
    r.mode = "sync"               # the group barrier: a step learns from whole groups sampled with the latest weights
    r.num_slots = 128
    r.replica = ml_collections.ConfigDict(dict(tensor=4))  # as experiments/sao.py
    r.param_dtype = "bfloat16"
    r.temperature = 1.0
    r.top_p = 1.0
    r.max_tool_turns = 20
    r.max_total_tokens = 24576
    r.max_turn_tokens = 8192
    c.rollout = r
    c.behaviour = common.behaviour_config()   # reward = effects_fraction x the behaviour multiplier, as SAO's

    c.devices = ml_collections.ConfigDict(dict(rollout=64, actor=64))
    c.mesh = common.mesh_config(("actor",))

    if tiny:
        common.tiny_common(c)
        tiny_sft(c.sft)
        c.sft.enabled = True                  # the same warm start as experiments/sao.py:tiny
        c.checkpoint.every = 5
        c.world.num_eval_tasks = 128          # the same held-out tasks and seeds as the tiny SAO run
        g.steps, g.batch_prompts, g.group_size = 80, 2, 8
        g.actor_micro_batches = 1
        g.pack_rows = False
        g.actor_optimizer.lr, g.actor_optimizer.grad_clip = 3e-5, 1.0
        r.num_slots = 16
        r.replica, r.param_dtype = ml_collections.ConfigDict(), ""  # one engine with the learner's fp32 weights
        r.max_tool_turns, r.max_total_tokens, r.max_turn_tokens = 4, 768, 192
        c.behaviour.malformed_strength = 0.25  # as the tiny SAO run
        c.devices = ml_collections.ConfigDict(dict(rollout=0, actor=0))
    return c
