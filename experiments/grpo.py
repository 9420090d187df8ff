"""Pivot GRPO: turn-level GRPO on stop-decision states of a browsing agent, K continuations per state, the
deterministic stop-verifier as reward, clipped surrogate + k3 KL to the frozen starting policy, a checkpoint every
step for the checkpoint sweep (docs/ALGORITHMS.md, pipeline 2).

The default is the released run: the SFT policy from an HF checkpoint, a pivot dataset built from that policy's
own browsing trajectories (`grpo.pivots_path`; built there first if missing), 16 states x 8 continuations, 32 steps,
eps 0.2 (`eps_high` 0.2), kl_coef 0.01 with k3, std-normalised group advantages, seq-mean-token-mean, actor Adam
lr 1e-6, bf16 compute, temperature 1:

    python -m mercury_jax.main --config experiments/grpo.py --workdir gs://bucket/grpo \
        --config.model.hf_path=/ckpt/browse-sft --config.grpo.pivots_path=/data/browse/pivots.jsonl

`:tiny` runs on a CPU: a tiny model with a SentencePiece tokenizer trained on the tiny browsing world's oracle
text, a short SFT warm start on oracle trajectories that over-search on purpose (`oracle.over_search_prob`),
pivot states cut from the same over-searching oracle on disjoint tasks, then 30 GRPO steps of 16 states x 8:

    python -m mercury_jax.main --config experiments/grpo.py:tiny

`:long` trains at the seed's own context: `rollout.max_total_tokens` 131,072 (pivot states cut from trajectories
of that length), the learner's rows split by position over 8 chips of `sequence` (fsdp 8 x sequence 8 on the
64 actor chips: 8 row shards, 16 micro-batches of one row each), long histories prefilled in 4,096-token chunks
(`rollout/sampler.py:prefill_chunk`); the SFT section is `experiments/sft.py:long`'s.
"""
from __future__ import annotations

import ml_collections

from experiments import common
from experiments.sft import LONG_MESH, long_sft, sft_config, tiny_sft


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    tiny = common.is_tiny("grpo", arg, common.VARIANTS + ("long",))
    c = common.base_config("grpo", world="browse")
    c.world.num_train_tasks = 20_000      # warm-start (SFT) tasks
    c.oracle = ml_collections.ConfigDict(dict(over_search_prob=0.5, over_search_max=2))  # the habit GRPO removes

    c.sft = sft_config()
    c.sft.enabled = False         # the released run starts from an HF checkpoint of the SFT policy
    c.sft.checkpoint = common.checkpoint_config(every=500)   # the warm start's own cadence
    c.checkpoint = common.checkpoint_config(every=1, keep=1000)  # every GRPO step: the sweep evaluates all of them

    g = ml_collections.ConfigDict()
    g.steps = 32
    g.batch_states = 16
    g.group_size = 8
    g.eps = 0.2
    g.eps_high = 0.2
    g.kl_coef = 0.01
    g.kl_estimator = "k3"
    g.reference_dtype = "bfloat16"       # the frozen reference's weights (never updated)
    g.std_normalize = True               # False: Dr. GRPO's A = R - mean
    g.filter_zero_variance = False       # all-equal groups are always counted; True drops them from the loss
    g.loss_agg = "seq-mean-token-mean"
    g.ppo_epochs = 1
    g.minibatches = 1                    # optimiser steps per epoch
    # gradient accumulation inside each optimiser step (train/microbatch.py): 128 rows over 64 actor chips = 2
    # rows per chip, so 2 micro-batches of 1 row per chip
    g.micro_batches = 2
    g.pack_rows = True                   # continuations share rows (train/packing.py); empty micro-batches skipped
    g.actor_optimizer = ml_collections.ConfigDict(dict(lr=1e-6, warmup_steps=0, b1=0.9, b2=0.999, eps=1e-8,
                                                       weight_decay=0.0, grad_clip=1.0))
    # the stop-verifier's reward per outcome (mercury_jax/envs/browse/stop_verifier.py): only a correct, grounded
    # stop and a continuation while the evidence is still insufficient earn reward
    g.stop_rules = ml_collections.ConfigDict(dict(correct_stop=1.0, continue_insufficient=1.0, over_search=0.0,
                                                  premature=0.0, ungrounded=0.0, wrong=0.0, malformed=0.0))
    g.pivots_path = "/data/browse/pivots.jsonl"  # "": build into WORKDIR/grpo/pivots.jsonl
    g.pivot_source = "policy"            # whose trajectories the pivots are cut from: "policy" or "oracle"
    g.pivot_kinds = ("just_sufficient", "one_step_before")
    g.pivot_tasks = 4096
    g.pivot_task_seed = 5_000            # disjoint from the warm start's (0..) and the held-out (10,000..) seeds
    g.log_window = 20
    c.grpo = g

    r = ml_collections.ConfigDict()
    r.num_slots = 128
    # R = devices.rollout / 4 engine replicas (16 here), num_slots / R slots each, one replica per v5p host (4
    # chips): no replica spans hosts; bf16 weights published device to device into each replica's layout (heads,
    # hidden units, expert units and the vocab over tensor). BENCHMARKS.md "rollout_aot" compares tensor=8.
    r.replica = ml_collections.ConfigDict(dict(tensor=4))
    r.param_dtype = "bfloat16"
    r.temperature = 1.0
    r.top_p = 1.0
    r.max_turn_tokens = 8192      # one continuation = one assistant turn
    r.max_total_tokens = 24576    # prompt + continuation (and policy episodes for the dataset)
    r.max_tool_turns = 20         # policy episodes that build the pivot dataset
    c.rollout = r
    c.behaviour = common.behaviour_config()   # the rewards of the policy episodes and the sweep's

    # Device groups (consecutive slices of jax.devices()); all 0 = everything shares the default device.
    # 64 / 64 with 16 replicas of 8 slots: the layout search (`bench.pod_search`, BENCHMARKS "Layout search") finds
    # nothing that fits more than 1% faster (23.5 s a step estimated; rollout 96 / actor 32, 4 slots a replica: 23.2 s).
    c.devices = ml_collections.ConfigDict(dict(rollout=64, actor=64))
    # The learner roles' meshes; the frozen reference lives on the actor's devices, on a mesh of its own shape.
    c.mesh = common.mesh_config(("actor", "reference"))

    if arg == "long":
        long_sft(c.sft)
        r.max_total_tokens = 131072
        g.micro_batches = 16      # 128 rows over 8 row shards: one 131,072-token row (over 8 chips) a micro-batch
        c.mesh = common.mesh_config(("actor", "reference"), **LONG_MESH)
    if tiny:
        common.tiny_common(c)
        c.world.num_train_tasks = 2048
        tiny_sft(c.sft)
        c.sft.enabled = True
        c.sft.steps, c.sft.batch_rows, c.sft.row_length = 560, 4, 1024
        c.sft.checkpoint.every = 50
        g.steps = 30
        g.micro_batches = 1
        g.pack_rows = False
        g.actor_optimizer.lr = 1e-4
        g.pivots_path, g.pivot_source, g.pivot_tasks = "", "oracle", 256
        r.num_slots, r.max_turn_tokens, r.max_total_tokens, r.max_tool_turns = 64, 48, 512, 4
        r.replica, r.param_dtype = ml_collections.ConfigDict(), ""  # one engine with the learner's fp32 weights
        c.devices = ml_collections.ConfigDict(dict(rollout=0, actor=0))
    return c
