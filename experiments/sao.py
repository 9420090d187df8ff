"""SAO: single rollout per prompt, learned critic with frozen token mixing, skip-observation GAE with
length-adaptive lambda, value pre-training, K critic epochs, DIS trust-region loss, asynchronous rollouts.

The default is the released run (Qwen3.5-35B-A3B from an HF checkpoint, 128 prompts x 1 rollout, 20 tool turns,
24,576 tokens, actor Adam lr 1e-6 betas (0.9, 0.98), critic lr 5e-6 with 10 warm-up iterations, 2 critic epochs,
20 critic-only steps, alpha 1.5, gamma 1, lam_critic 1, eps 0.2/0.28, bf16 compute):

    python -m mercury_jax.main --config experiments/sao.py --workdir gs://bucket/sao \
        --config.model.hf_path=/ckpt/Qwen3.5-35B-A3B --config.world.corpus_dir=/data/enterprise

`:tiny` runs on one CPU from scratch: a tiny model, a SentencePiece tokenizer trained on the tiny enterprise
world's oracle text, an SFT warm start on oracle trajectories, then SAO:

    python -m mercury_jax.main --config experiments/sao.py:tiny
"""
from __future__ import annotations

import ml_collections

from experiments import common
from experiments.sft import sft_config, tiny_sft


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    tiny = common.is_tiny("sao", arg)
    c = common.base_config("sao")
    c.sft = sft_config()
    c.sft.enabled = False         # the released run starts from an HF checkpoint
    c.checkpoint = common.checkpoint_config(every=10)

    s = ml_collections.ConfigDict()
    s.steps = 159
    s.batch_prompts = 128         # one rollout per prompt (SAO has no groups)
    s.critic_only_steps = 20
    s.critic_epochs = 2
    s.policy_loss = "dis"         # the decoupled trust-region loss ("ppo": the clipped surrogate)
    s.alpha = 1.5
    s.gamma = 1.0
    s.lam_critic = 1.0
    s.eps_low = 0.2
    s.eps_high = 0.28
    s.loss_agg = "token-mean"
    s.whiten_advantages = False
    s.value_clip = 0.0
    s.max_staleness = 1
    # gradient accumulation inside each learner step (train/microbatch.py): 128 rows over 32 actor (critic) chips
    # = 4 rows per chip, so 4 micro-batches of 1 row per chip (one 24,576-token row's activations at a time)
    s.actor_micro_batches = 4
    s.critic_micro_batches = 4
    # trajectories share rows (first-fit decreasing, segment ids; train/packing.py): the filled rows take the first
    # micro-batches and an empty micro-batch is skipped, so a step pays for the tokens it holds
    s.pack_rows = True
    s.actor_optimizer = ml_collections.ConfigDict(dict(lr=1e-6, warmup_steps=0, b1=0.9, b2=0.98, eps=1e-8,
                                                       weight_decay=0.0, grad_clip=0.0))
    s.critic_optimizer = ml_collections.ConfigDict(dict(lr=5e-6, warmup_steps=10, b1=0.9, b2=0.98, eps=1e-8,
                                                        weight_decay=0.0, grad_clip=1.0))
    s.eval_every = 20
    s.log_window = 20
    c.sao = s

    r = ml_collections.ConfigDict()
    r.mode = "async"              # "sync": every batch sampled with the latest weights (exactly resumable)
    r.num_slots = 128
    # R = devices.rollout / 4 engine replicas (16 here), num_slots / R slots each, one replica per v5p host (4
    # chips): no replica spans hosts; bf16 weights published device to device into each replica's layout (heads,
    # hidden units, expert units and the vocab over tensor). BENCHMARKS.md "rollout_aot" compares tensor=8.
    r.replica = ml_collections.ConfigDict(dict(tensor=4))
    r.param_dtype = "bfloat16"
    r.temperature = 1.0
    r.top_p = 1.0
    r.max_tool_turns = 20
    r.max_total_tokens = 24576
    r.max_turn_tokens = 8192
    c.rollout = r
    c.behaviour = common.behaviour_config()   # reward = effects_fraction x the behaviour multiplier

    # Device groups (consecutive slices of jax.devices()); all 0 = everything shares the default device.
    # 64 / 32 / 32 with 16 replicas of 8 slots: the layout search (`bench.pod_search`, BENCHMARKS "Layout search")
    # finds nothing faster that fits: 20.1 s a step estimated at staleness 1, the best layout 19.6 s needs a 16-chip
    # actor step 0.35 GiB over the HBM headroom. The rollout's throughput sets the step; the learner idles ~40%.
    c.devices = ml_collections.ConfigDict(dict(rollout=64, actor=32, critic=32))
    # Each learner role's mesh over its group: parameters, Adam states and rows over fsdp (32-way).
    c.mesh = common.mesh_config(("actor", "critic"))

    if tiny:
        common.tiny_common(c)
        tiny_sft(c.sft)
        c.sft.enabled = True                  # warm start on oracle trajectories, then SAO
        c.checkpoint.every = 5
        c.world.num_eval_tasks = 128          # held-out reward to +-0.045 (sem)
        s.steps, s.batch_prompts, s.critic_only_steps = 80, 16, 3
        s.actor_micro_batches = s.critic_micro_batches = 1
        s.pack_rows = False
        s.actor_optimizer.lr, s.actor_optimizer.grad_clip = 3e-5, 1.0
        s.critic_optimizer.lr = 1e-3
        r.mode, r.num_slots = "sync", 16
        r.replica, r.param_dtype = ml_collections.ConfigDict(), ""  # one engine with the learner's fp32 weights
        r.max_tool_turns, r.max_total_tokens, r.max_turn_tokens = 4, 768, 192
        c.behaviour.malformed_strength = 0.25  # a malformed call costs a quarter of the reward
        c.devices = ml_collections.ConfigDict(dict(rollout=0, actor=0, critic=0))
    return c
