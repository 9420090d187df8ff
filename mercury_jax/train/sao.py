"""The SAO algorithm: rollouts -> critic values -> skip-observation GAE -> K critic updates -> one DIS policy update
(docs/ALGORITHMS.md, pipeline 1; the per-step math is in `sao_learner.py`, the loop around it in `loop.py`).

Device groups come from `config.devices` (rollout / actor / critic; all 0 = one shared device): the actor and the
critic each live on their own mesh (`config.mesh.<role>`, `placement.py`), the policy created or loaded straight
into the actor's sharding and the critic's backbone copied from it straight into the critic's; the rollout side
(`rollouts.py`) on the rollout devices with a copy of the actor's weights that the loop replaces after every policy
update (version = policy updates so far). `rollout.mode = "sync"` samples every batch with the latest weights,
episode e of the run always being request block e with the run's seed, so a killed run resumes bit-for-bit;
`"async"` keeps a `RolloutWorker` generating in the background and drops trajectories more than `sao.max_staleness`
versions old (`dropped_stale`). An async resume restarts from the tasks handed out at the checkpoint (episodes in
flight then are not replayed), so it is not bit-exact. A non-finite critic or actor update raises `NonFiniteError`
naming the step (or, with `train.nonfinite="skip"`, skips the rest of the step: no publish, no version).

Held-out evaluations run the same tasks with the same sampling seeds every time (`WORKDIR/sao/evals.jsonl`); the
run ends with the paired comparison of the last against the warm start (`eval_summary.json`, `sao_heldout.png`).
"""
from __future__ import annotations

import json
import os
import time

import ml_collections
import numpy as np

from mercury_jax.parallel.distributed import fetch
from mercury_jax.rollout.trajectory import batch_trajectories, padded_length
from mercury_jax.runs.rundir import append_line
from mercury_jax.train.episode_metrics import barrier_wait, length_spread, trajectory_metrics
from mercury_jax.train.loop import Cadence, StepResult
from mercury_jax.train.packing import pack_batch, rows_used
from mercury_jax.train.placement import batch_to_mesh, step_shardings
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step
from mercury_jax.train.wiring import Wiring, run_pipeline
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable


def run_sao(config: ml_collections.ConfigDict, workdir: str | os.PathLike, seams: Seams = Seams()):
    """Warm start (when `sft.enabled`), then SAO; returns (actor model, critic model, metric history)."""
    algorithm, history = run_pipeline(config, workdir, seams, Sao, sao_cadence(config))
    return algorithm.actor.model(), algorithm.critic.model(), history


def sao_cadence(config: ml_collections.ConfigDict) -> Cadence:
    """Checkpoints per `config.checkpoint`; held-out evaluations every `sao.eval_every` steps."""
    return Cadence.from_config(config.checkpoint, eval_every=config.sao.eval_every, log_window=config.sao.log_window)


class Sao:
    stage = "sao"
    final_label = "after SAO"
    progress_keys = ("reward", "all_effects_pass", "truncation_rate", "value_loss", "dis_masked_fraction")
    plot_keys = ("reward", "all_effects_pass", "truncation_rate", "response_length", "value_loss",
                 "explained_variance", "dis_masked_fraction")

    def __init__(self, wiring: Wiring):
        config, model = wiring.config, wiring.model
        self.cfg, self.rcfg, self.tokenizer, self.stage_dir = config.sao, config.rollout, wiring.tokenizer, wiring.stage
        self.logs = (wiring.stage.batches,)  # truncated to the checkpoint's step on a resume
        self.steps, self.meshes = self.cfg.steps, wiring.meshes
        critic = Qwen35MoeCritic.from_policy(model, mesh=self.meshes["critic"])
        self.actor = wiring.learner(model, self.cfg.actor_optimizer)
        self.critic = wiring.learner(critic, self.cfg.critic_optimizer, "critic", critic_trainable)
        self.actor_step = make_actor_step(self.actor.graphdef, self.actor.tx, self.cfg,
                                          state_shardings=step_shardings(self.actor))
        self.critic_step = make_critic_step(self.critic.graphdef, self.critic.tx, self.cfg,
                                            state_shardings=step_shardings(self.critic))
        self.advantage_fn = make_advantage_fn(self.critic.graphdef, self.cfg, mesh=self.meshes["critic"])
        self.stream = wiring.task_stream()
        self.rollouts = wiring.rollouts(mode=self.rcfg.mode, max_staleness=self.cfg.max_staleness,
                                        queue_size=self.cfg.batch_prompts)
        self.heldout = wiring.heldout(self.rollouts, title="SAO")  # their own seed stream

    # -- what the loop checkpoints --
    def arrays(self) -> dict:
        return {"actor": self.actor.arrays(), "critic": self.critic.arrays()}

    def meta(self) -> dict:
        return {"tasks_consumed": self.stream.consumed, **self.rollouts.meta()}

    def restore(self, arrays: dict, meta: dict) -> None:
        self.actor = self.actor.replace_arrays(arrays["actor"])
        self.critic = self.critic.replace_arrays(arrays["critic"])
        self.stream.consumed = meta["tasks_consumed"]
        self.rollouts.restore(meta)

    def policy(self):
        return self.actor.model()

    # -- one step --
    def step(self, step: int, *, version: int, guard) -> StepResult:
        t0 = time.perf_counter()
        self.rollouts.mark_usage()
        trajectories, stale, env_dropped = self.rollouts.collect(self.stream, self.cfg.batch_prompts)
        rollout_s = time.perf_counter() - t0
        staleness = np.array([version - t.policy_version for t in trajectories])
        append_line(self.stage_dir.batches, json.dumps({
            "step": step, "version": version, "episode_ids": [t.episode_id for t in trajectories],
            "task_ids": [t.task_id for t in trajectories],
            "policy_lag": staleness.tolist(), "dropped_stale": stale, "env_failures": env_dropped}))
        length = padded_length(trajectories, self.rcfg.max_total_tokens)
        host_batch = batch_trajectories(trajectories, length, pad_id=self.tokenizer.pad_id)
        lengths = host_batch.pop("lengths")
        if self.cfg.pack_rows:
            host_batch = pack_batch(host_batch, lengths, self.cfg.actor_micro_batches, pad_id=self.tokenizer.pad_id)

        critic, actor = self.critic, self.actor
        critic_batch = batch_to_mesh(host_batch, self.meshes["critic"])
        adv, returns, values, adv_stats = self.advantage_fn(critic.params, critic.frozen, critic_batch)
        critic_batch.update(returns=returns, old_values=values)
        applied = True  # a non-finite critic or actor update skips the rest of the step (guards.py)
        for _ in range(self.cfg.critic_epochs):
            critic.params, critic.opt_state, critic_metrics = self.critic_step(critic.params, critic.frozen,
                                                                               critic.opt_state, critic_batch)
            critic_metrics = fetch(critic_metrics)
            applied = guard.check(step, critic_metrics, what="critic update")
            if not applied:
                break
        metrics = {**trajectory_metrics(trajectories), **fetch(adv_stats),
                   "value_loss": float(critic_metrics["value_loss"]),
                   "critic_grad_norm": float(critic_metrics["grad_norm"])}
        updated = False
        if step > self.cfg.critic_only_steps and applied:
            actor_batch = batch_to_mesh({**host_batch, "advantages": fetch(adv)}, self.meshes["actor"])
            actor.params, actor.opt_state, actor_metrics = self.actor_step(actor.params, actor.frozen,
                                                                           actor.opt_state, actor_batch)
            actor_metrics = fetch(actor_metrics)
            applied = updated = guard.check(step, actor_metrics, what="actor update")
            metrics.update({k: float(v) for k, v in actor_metrics.items() if k != "loss"})
        metrics.update(staleness_mean=float(staleness.mean()), staleness_max=int(staleness.max()),
                       dropped_stale=stale, env_failures=env_dropped, tokens=sum(len(t.tokens) for t in trajectories),
                       rollout_s=rollout_s, learner_s=time.perf_counter() - t0 - rollout_s, batch_length=length,
                       rows_used=rows_used(host_batch), **self.rollouts.accounting(), **self.rollouts.usage(),
                       **length_spread(trajectories), **barrier_wait(trajectories))
        return StepResult(metrics, policy_updated=updated, applied=applied)

    # -- held-out evaluation --
    def evaluate(self, label: str) -> dict:
        return self.heldout.evaluate(label)

    def finish(self, history: list[dict], evaluations: list[dict]) -> None:
        self.heldout.finish(evaluations, self.final_label)


run = run_sao  # the pipeline's entry (config/registry.py)
