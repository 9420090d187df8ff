"""Episode-level group-baseline RL on the enterprise world: the algorithm SAO is measured against (docs/ALGORITHMS.md,
"The group baseline"). What the rest of the model family trains with, on SAO's own episodes, reward and losses.

    each step:  B tasks from the seeded epoch order, K episodes of each (episode n * K + k for the n-th task of the
                run: same seed, same request ids, so a resumed run samples the same tokens)
    barrier:    the step learns when all B x K episodes have finished (whole groups only)
    advantage:  A[g, k] = R[g, k] - mean_k R[g, :]  (/ (std_k R[g, :] + 1e-6) with `std_normalize`), on every
                action token of trajectory (g, k); observation tokens are never trained on
    update:     one actor update with SAO's policy loss (`policy_loss` "dis", or "ppo"), no critic, no KL

A group whose rewards are all equal has A = 0 (no signal): counted, and dropped with `filter_zero_variance` (its
rows get an empty action mask, as pivot GRPO's). A group in which an environment failed is dropped whole (its
baseline would be the mean of the clean siblings only). The reward is SAO's (effects fraction x the behaviour
multiplier); held-out evaluations are SAO's (the same tasks and seeds, so the two pipelines' evaluations pair).
Rollouts are sync only: the barrier is the point of the comparison (`python -m mercury_jax.bench.sao_vs_group`).

Checkpoints hold `{"actor": actor.arrays()}` and meta {step, tasks_consumed}.
"""
from __future__ import annotations

import os
import time

import ml_collections
import numpy as np

from mercury_jax.config.defaults import setting
from mercury_jax.parallel.distributed import fetch
from mercury_jax.rl.advantages import group_advantages
from mercury_jax.rollout.trajectory import padded_length
from mercury_jax.train.episode_metrics import barrier_wait, length_spread, trajectory_metrics
from mercury_jax.train.group_batch import group_batch
from mercury_jax.train.loop import Cadence, StepResult
from mercury_jax.train.packing import pack_batch, rows_used
from mercury_jax.train.placement import batch_to_mesh, step_shardings
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.sao_learner import make_actor_step
from mercury_jax.train.wiring import Wiring, run_pipeline


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike, seams: Seams = Seams()):
    """Warm start (when `sft.enabled`), then group-baseline RL; returns (actor model, metric history)."""
    cfg = config.group_baseline
    cadence = Cadence.from_config(config.checkpoint, eval_every=cfg.eval_every, log_window=cfg.log_window)
    algorithm, history = run_pipeline(config, workdir, seams, GroupBaseline, cadence)
    return algorithm.actor.model(), history


class GroupBaseline:
    stage = "group_baseline"
    final_label = "after group-baseline RL"
    progress_keys = ("reward", "all_effects_pass", "truncation_rate", "zero_variance_fraction", "barrier_wait_s")
    plot_keys = ("reward", "all_effects_pass", "truncation_rate", "response_length", "zero_variance_fraction",
                 "dis_masked_fraction", "barrier_wait_s")

    def __init__(self, wiring: Wiring):
        config = wiring.config
        self.cfg, self.rcfg, self.tokenizer = config.group_baseline, config.rollout, wiring.tokenizer
        self.steps, self.meshes = self.cfg.steps, wiring.meshes
        self.actor = wiring.learner(wiring.model, self.cfg.actor_optimizer)
        self.actor_step = make_actor_step(self.actor.graphdef, self.actor.tx, self.cfg,
                                          state_shardings=step_shardings(self.actor))
        self.stream = wiring.task_stream()
        self.rollouts = wiring.rollouts()
        self.heldout = wiring.heldout(self.rollouts, title="Group-baseline RL")

    # -- what the loop checkpoints --
    def arrays(self) -> dict:
        return {"actor": self.actor.arrays()}

    def meta(self) -> dict:
        return {"tasks_consumed": self.stream.consumed}

    def restore(self, arrays: dict, meta: dict) -> None:
        self.actor = self.actor.replace_arrays(arrays["actor"])
        self.stream.consumed = meta["tasks_consumed"]

    def policy(self):
        return self.actor.model()

    # -- one step --
    def step(self, step: int, *, version: int, guard) -> StepResult:
        cfg, K = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        self.rollouts.mark_usage()
        tasks = self.stream.take(cfg.batch_prompts)
        first = self.stream.consumed - len(tasks)
        trajectories = self.rollouts.run(tasks.repeated(K), first_episode_id=first * K)
        rollout_s = time.perf_counter() - t0
        host_batch, metrics = self._batch(trajectories, len(tasks))
        updated, applied = False, True
        if metrics["groups_kept"]:
            actor = self.actor
            actor_batch = batch_to_mesh(host_batch, self.meshes["actor"])
            actor.params, actor.opt_state, actor_metrics = self.actor_step(actor.params, actor.frozen,
                                                                           actor.opt_state, actor_batch)
            actor_metrics = fetch(actor_metrics)
            applied = updated = guard.check(step, actor_metrics, what="actor update")
            metrics.update({k: float(v) for k, v in actor_metrics.items() if k != "loss"})
        metrics.update(tokens=sum(len(t.tokens) for t in trajectories), rollout_s=rollout_s,
                       learner_s=time.perf_counter() - t0 - rollout_s, rows_used=rows_used(host_batch),
                       **self.rollouts.usage(), **length_spread(trajectories), **barrier_wait(trajectories, K))
        return StepResult(metrics, policy_updated=updated, applied=applied)

    def _batch(self, trajectories: list, num_groups: int) -> tuple[dict, dict]:
        """The learner batch (group advantages on the action tokens of the kept groups' rows) and its metrics."""
        cfg, K = self.cfg, self.cfg.group_size
        rewards_GxK = np.array([t.reward for t in trajectories], np.float32).reshape(num_groups, K)
        advantages_GxK, stats = group_advantages(rewards_GxK, std_normalize=cfg.std_normalize, return_stats=True)
        clean_G = np.array([t.env_failure is None for t in trajectories]).reshape(num_groups, K).all(axis=1)
        keep_G = clean_G & (np.asarray(stats["keep"]) if cfg.filter_zero_variance else True)
        length = padded_length(trajectories, self.rcfg.max_total_tokens)
        host_batch = group_batch(trajectories, np.asarray(advantages_GxK), keep_G, length,
                                 pad_id=self.tokenizer.pad_id)
        if cfg.pack_rows:
            host_batch = pack_batch(host_batch, [len(t.tokens) for t in trajectories],
                                    setting(cfg, "actor_micro_batches"), pad_id=self.tokenizer.pad_id)
        clean = [t for t in trajectories if t.env_failure is None] or trajectories
        metrics = {**trajectory_metrics(clean), "zero_variance_fraction": float(stats["zero_variance_fraction"]),
                   "groups_kept": int(keep_G.sum()), "env_failure_groups": int((~clean_G).sum()),
                   "advantage_abs_mean": float(np.abs(np.asarray(advantages_GxK)).mean()), "batch_length": length}
        return host_batch, metrics

    # -- held-out evaluation --
    def evaluate(self, label: str) -> dict:
        return self.heldout.evaluate(label)

    def finish(self, history: list[dict], evaluations: list[dict]) -> None:
        self.heldout.finish(evaluations, self.final_label)
