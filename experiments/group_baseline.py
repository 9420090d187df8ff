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

from experiments import common, sao

# what the comparison holds equal comes from SAO's own config (released or :tiny): model, tokenizer, world, warm
# start, checkpoints, rollout (made sync), reward; and the actor's loss, optimiser, steps and cadences
MATCHED = ("seed", "model", "tokenizer", "world", "train", "device_layout", "sft", "checkpoint", "rollout",
           "behaviour")
MATCHED_ACTOR = ("steps", "policy_loss", "eps_low", "eps_high", "loss_agg", "pack_rows", "actor_optimizer",
                 "eval_every", "log_window")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    tiny = common.is_tiny("group_baseline", arg)
    matched = sao.get_config(arg)
    c = ml_collections.ConfigDict()
    c.pipeline = "group_baseline"
    for name in MATCHED:
        c[name] = matched[name]
    c.rollout.mode = "sync"       # the group barrier: a step learns from whole groups sampled with the latest weights

    g = ml_collections.ConfigDict({name: matched.sao[name] for name in MATCHED_ACTOR})
    g.group_size = 8              # episodes of each task (the family's K)
    g.batch_prompts = matched.sao.batch_prompts // g.group_size  # tasks a step: SAO's episodes a step in groups
    g.std_normalize = True        # A = (R - mean) / (std + 1e-6); False: A = R - mean
    g.filter_zero_variance = False  # all-equal groups have A = 0 anyway; True also drops their rows
    g.actor_micro_batches = 2     # 128 rows over 64 actor chips, one row per chip at a time (as SAO's actor)
    c.group_baseline = g

    # SAO's chips: its rollout group, and both learner groups for the actor
    c.devices = ml_collections.ConfigDict(dict(rollout=matched.devices.rollout,
                                               actor=matched.devices.actor + matched.devices.critic))
    c.mesh = common.mesh_config(("actor",))
    if tiny:
        g.actor_micro_batches = matched.sao.actor_micro_batches
    return c
