"""The pivot-GRPO algorithm: pivot states -> K one-turn episodes each -> stop-verifier rewards -> group advantages ->
clipped surrogate + k3 KL to the frozen reference (docs/ALGORITHMS.md, pipeline 2; the per-step math is in
`grpo_learner.py`, the loop around it in `loop.py`).

A pivot state is a one-turn episode whose prompt is a chat prefix: its task holds the rendered `prompt_ids`, the
prefix and the task's tools, and it runs on the same `EpisodeRunner` -> `Trajectory` -> `batch_trajectories` path
as SAO's episodes, with `max_tool_turns = 0` (a tool-calling turn ends the episode unexecuted), the
`PrefixEpisode` environment and the `StopVerifierReward`. One step takes `batch_states` states from the seeded
epoch order (`data/task_order.py`, grain) and samples `group_size` episodes of each: continuation k of the n-th
state of the run is episode n * K + k (one turn, so request n * K + k) with the run's seed, so its tokens depend
only on the weights. Rewards [G, K] give `group_advantages` (std normalisation switchable); all-equal groups are always
counted and, with `filter_zero_variance`, dropped (their rows get an empty action mask). The frozen reference
(the starting policy in `reference_dtype`, on the actor's devices in a mesh of its own, `mesh.reference`, never
updated) scores
the batch, then `ppo_epochs` x `minibatches` actor updates run and the loop publishes the new weights.

Checkpoints hold `{"actor": actor.arrays()}` and meta {step, version, states_consumed}; step 0 is the starting
policy, saved before the first update (the checkpoint sweep compares every step against it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import grain
import jax.numpy as jnp
import ml_collections
import numpy as np

from mercury_jax.config.rollout import episode_settings
from mercury_jax.config.world import world_tasks
from mercury_jax.data.seeds import derived_seed
from mercury_jax.envs.browse.stop_verifier import STOP_RULES
from mercury_jax.envs.prefix_episode import PrefixEpisode
from mercury_jax.parallel.distributed import all_gather_objects, fetch
from mercury_jax.rl.advantages import group_advantages
from mercury_jax.rollout.rewards import StopVerifierReward
from mercury_jax.rollout.trajectory import Trajectory, padded_length
from mercury_jax.runs.rundir import RunDir, append_line, write_text
from mercury_jax.train.group_batch import group_batch
from mercury_jax.train.grpo_learner import (
    frozen_reference,
    make_grpo_step,
    make_reference_logprobs,
    reference_micro_batches,
)
from mercury_jax.train.guards import NonFiniteGuard
from mercury_jax.train.loop import Cadence, StepResult
from mercury_jax.train.packing import pack_batch, rows_used
from mercury_jax.train.pivot_data import build_pivots, prompt_ids, read_pivots, task_tool_schemas
from mercury_jax.train.placement import batch_to_mesh, step_shardings
from mercury_jax.train.rollouts import Seams
from mercury_jax.train.state import TrainState
from mercury_jax.train.warm_start import starting_policy_name
from mercury_jax.train.wiring import Wiring, run_pipeline

LEARNER_KEYS = ("loss", "policy_loss", "kl_loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction",
                "mean_ratio", "grad_norm", "logp_train_rollout_gap")
PIVOT_EPISODE_SEED_OFFSET = 2_000_003  # the policy's own episodes that a pivot dataset is cut from


def run_grpo(config: ml_collections.ConfigDict, workdir: str | os.PathLike, seams: Seams = Seams()):
    """Warm start (when `sft.enabled`), then pivot GRPO; returns (actor model, metric history, reference
    (graphdef, state))."""
    algorithm, history = run_pipeline(config, workdir, seams, PivotGrpo, grpo_cadence(config))
    return algorithm.actor.model(), history, (algorithm.reference_graphdef, algorithm.reference_state)


def grpo_cadence(config: ml_collections.ConfigDict) -> Cadence:
    """Checkpoints per `config.checkpoint`, step 0 (the starting policy) included, for the sweep."""
    return Cadence.from_config(config.checkpoint, log_window=config.grpo.log_window, save_initial=True)


class PivotGrpo:
    stage = "grpo"
    progress_keys = ("reward", "outcome_correct_stop", "over_search_rate", "zero_variance_fraction", "kl",
                     "clip_fraction")
    plot_keys = ("reward", "outcome_correct_stop", "over_search_rate", "stop_rate_sufficient", "premature_rate",
                 "zero_variance_fraction", "kl", "clip_fraction", "grad_norm")

    def __init__(self, wiring: Wiring):
        config, model, tokenizer = wiring.config, wiring.model, wiring.tokenizer
        self.config, self.cfg, self.rcfg, self.tokenizer = config, config.grpo, config.rollout, tokenizer
        self.stage_dir, self.steps, self.logs = wiring.stage, config.grpo.steps, (wiring.stage.samples,)
        self.wiring, self.meshes = wiring, wiring.meshes
        self.actor = wiring.learner(model, self.cfg.actor_optimizer)
        self.reference_graphdef, self.reference_state = frozen_reference(model, jnp.dtype(self.cfg.reference_dtype),
                                                                         mesh=self.meshes["reference"])
        self.reference_logprobs = make_reference_logprobs(self.reference_graphdef, mesh=self.meshes["reference"],
                                                          micro_batches=reference_micro_batches(self.cfg))
        self.actor_step = make_grpo_step(self.actor.graphdef, self.actor.tx, self.cfg,
                                         state_shardings=step_shardings(self.actor))
        episodes = wiring.episodes(StopVerifierReward(tokenizer, dict(STOP_RULES, **self.cfg.stop_rules.to_dict())))
        one_turn = dataclasses.replace(episodes.budgets, max_tool_turns=0)  # a pivot state: its stop decision only
        self.rollouts = wiring.rollouts(dataclasses.replace(episodes, budgets=one_turn, environment=PrefixEpisode))
        states = wiring.seams.tasks("train") if wiring.seams.tasks else self.pivot_states()
        self.stream = wiring.task_stream(states)

    # -- what the loop checkpoints --
    def arrays(self) -> dict:
        return {"actor": self.actor.arrays()}

    def meta(self) -> dict:
        return {"states_consumed": self.stream.consumed}

    def restore(self, arrays: dict, meta: dict) -> None:
        self.actor = self.actor.replace_arrays(arrays["actor"])
        self.stream.consumed = meta["states_consumed"]

    def policy(self):
        return self.actor.model()

    # -- one step --
    def step(self, step: int, *, version: int, guard: NonFiniteGuard) -> StepResult:
        cfg, K = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        states = self.stream.take(cfg.batch_states)
        first_state = self.stream.consumed - len(states)
        trajectories = self.rollouts.run(states.repeated(K), first_episode_id=first_state * K)
        rollout_s = time.perf_counter() - t0
        rewards_GxK = np.array([t.reward for t in trajectories], np.float32).reshape(len(states), K)
        advantages_GxK, group_stats = group_advantages(rewards_GxK, std_normalize=cfg.std_normalize,
                                                       return_stats=True)
        keep_G = np.asarray(group_stats["keep"]) if cfg.filter_zero_variance else np.ones(len(states), bool)
        length = padded_length(trajectories, self.rcfg.max_total_tokens)
        host_batch = group_batch(trajectories, np.asarray(advantages_GxK), keep_G, length,
                                 pad_id=self.tokenizer.pad_id)
        if cfg.pack_rows:
            host_batch = pack_batch(host_batch, [len(t.tokens) for t in trajectories], cfg.micro_batches,
                                    pad_id=self.tokenizer.pad_id)
        metrics = {**outcome_metrics(states, trajectories),
                   "zero_variance_fraction": float(group_stats["zero_variance_fraction"]),
                   "num_zero_variance": int(group_stats["num_zero_variance"]), "groups_kept": int(keep_G.sum()),
                   "advantage_abs_mean": float(np.abs(advantages_GxK).mean())}
        t1 = time.perf_counter()
        updated, applied, reference_s = False, True, 0.0
        if keep_G.any():
            forward = batch_to_mesh({k: host_batch[k] for k in ("tokens", "segment_ids") if k in host_batch},
                                    self.meshes["reference"])
            host_batch["ref_logprobs"] = np.asarray(fetch(self.reference_logprobs(
                self.reference_state, forward["tokens"], forward.get("segment_ids"))))
            reference_s = time.perf_counter() - t1
            learner_metrics, applied = update_actor(self.actor, self.actor_step, host_batch, self.meshes["actor"],
                                                    cfg, seed=self.config.seed, step=step, guard=guard)
            metrics.update(learner_metrics)
            updated = applied
        else:  # nothing to learn from (every group filtered): no optimiser step, so Adam's momentum cannot move us
            print(f"[grpo] step {step}: every group has zero reward variance; update skipped", flush=True)
        generated = sum(t.num_action_tokens for t in trajectories)
        metrics.update(update_skipped=int(not keep_G.any()), states_consumed=self.stream.consumed,
                       tokens=sum(len(t.tokens) for t in trajectories),
                       generated_tokens_per_s=generated / max(rollout_s, 1e-9), rollout_s=rollout_s,
                       reference_s=reference_s, learner_s=time.perf_counter() - t1 - reference_s,
                       batch_length=length, rows_used=rows_used(host_batch))
        write_samples(self.stage_dir.samples, step, states, trajectories)
        return StepResult(metrics, policy_updated=updated, applied=applied)

    def finish(self, history: list[dict], evaluations: list[dict]) -> None:
        if history:
            write_text(self.stage_dir.summary, json.dumps({"first": history[0], "last": history[-1],
                                                          "steps": self.steps}, indent=2))

    # -- the pivot dataset --
    def pivot_states(self) -> list[dict]:
        """The pivot dataset (built first if missing) as one-turn episode tasks {task_id, prompt_ids, prefix,
        tools, task, record}, without those whose prompt leaves fewer than `max_turn_tokens` under
        `max_total_tokens`."""
        config, cfg, rcfg = self.config, self.cfg, self.rcfg
        path = RunDir(cfg.pivots_path).root if cfg.pivots_path else self.stage_dir.pivots
        if not all_gather_objects(path.exists())[0]:  # process 0's view: every process builds it, or none
            self.stage_dir.make()
            tasks = world_tasks(pivot_world(config), "train")
            run_episodes = None
            if cfg.pivot_source == "policy":
                seed = config.seed + PIVOT_EPISODE_SEED_OFFSET  # whole browsing episodes with the world's reward
                runner = self.rollouts.evaluator(seed, episode_settings(config, seed))
                run_episodes = runner.run
            t0 = time.perf_counter()
            counts = build_pivots(tasks, path, source=cfg.pivot_source, oracle_options=config.oracle.to_dict(),
                                  run_episodes=run_episodes, kinds=tuple(cfg.pivot_kinds),
                                  policy_version=starting_policy_name(config) if cfg.pivot_source == "policy"
                                  else None)
            print(f"[grpo] pivot dataset {path}: {counts['pivots']} states ({counts['sufficient']} with sufficient "
                  f"evidence) from {counts['tasks_with_pivots']}/{counts['tasks']} {cfg.pivot_source} trajectories "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
        records = read_pivots(path)
        if not records:
            raise ValueError(f"pivot dataset {path} holds no states: no {cfg.pivot_source} trajectory reached a "
                             f"stop decision (evidence became sufficient); start from a stronger policy, raise "
                             f"grpo.pivot_tasks, or use grpo.pivot_source='oracle' (and delete the empty file)")
        budget = rcfg.max_total_tokens - rcfg.max_turn_tokens
        states, too_long = [], 0
        for record, tools in zip(records, task_tool_schemas([r["task"] for r in records])):
            ids = prompt_ids(self.tokenizer, record["prefix"], tools)
            if len(ids) > budget:
                too_long += 1
                continue
            states.append({"task_id": record["task_id"], "prompt_ids": ids, "prefix": record["prefix"],
                           "tools": tools, "task": record["task"], "record": record})
        if not states:
            raise ValueError(f"no pivot state of {path} fits: every prompt is longer than rollout.max_total_tokens "
                             f"- rollout.max_turn_tokens = {budget}; raise rollout.max_total_tokens")
        lengths = [len(s["prompt_ids"]) for s in states]
        print(f"[grpo] {len(states)} pivot states ({sum(s['record']['evidence_sufficient'] for s in states)} "
              f"sufficient; {too_long} dropped as too long), prompts {min(lengths)}-{max(lengths)} tokens",
              flush=True)
        return states


def pivot_world(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The world config of the pivot tasks: the train split at `grpo.pivot_task_seed` (disjoint from the warm
    start's tasks) with `grpo.pivot_tasks` tasks; a corpus directory's train slice is used as it is."""
    world = ml_collections.ConfigDict(config.world.to_dict())
    world.train_seed, world.num_train_tasks = config.grpo.pivot_task_seed, config.grpo.pivot_tasks
    return world


# ------------------------------------------------------------------------------------------------ one step
def outcome_metrics(states: list[dict], trajectories: list[Trajectory]) -> dict:
    """Reward, the fraction of each verifier outcome, and the stop behaviour split by the state's label:
    stop_rate_sufficient (answers at sufficient states), over_search_rate (tool calls at sufficient states),
    premature_rate (answers at insufficient states); plus cut-off rate and response length (action tokens)."""
    K = len(trajectories) // len(states)
    verdicts = [{**t.reward_parts, "reward": t.reward,
                 "evidence_sufficient": states[i // K]["record"]["evidence_sufficient"]}
                for i, t in enumerate(trajectories)]
    sufficient = [v for v in verdicts if v["evidence_sufficient"]]
    insufficient = [v for v in verdicts if not v["evidence_sufficient"]]

    def rate(items, outcomes):
        return float(np.mean([v.get("outcome") in outcomes for v in items])) if items else None  # null: none

    rewards = np.array([t.reward for t in trajectories])
    metrics = {"reward": float(rewards.mean()), "reward_std": float(rewards.std())}
    metrics.update({f"outcome_{name}": rate(verdicts, (name,)) for name in STOP_RULES})
    metrics.update(stop_rate_sufficient=rate(sufficient, ("correct_stop", "ungrounded", "wrong")),
                   over_search_rate=rate(sufficient, ("over_search",)),
                   premature_rate=rate(insufficient, ("premature",)),
                   sufficient_state_fraction=float(np.mean([s["record"]["evidence_sufficient"] for s in states])),
                   cut_off_rate=float(np.mean([bool(v.get("cut_off")) for v in verdicts])),
                   response_length=float(np.mean([t.num_action_tokens for t in trajectories])))
    return metrics


def write_samples(path, step: int, states: list[dict], trajectories: list[Trajectory]) -> None:
    """Append every continuation of the step (state, decoded text, verdict) to a JSONL file, for reading what the
    policy does at each kind of state."""
    K = len(trajectories) // len(states)
    lines = []
    for i, t in enumerate(trajectories):
        record = states[i // K]["record"]
        lines.append(json.dumps({"step": step, "task_id": record["task_id"], "kind": record["kind"],
                                 "evidence_sufficient": record["evidence_sufficient"],
                                 "gold": states[i // K]["task"]["answer"], "outcome": t.reward_parts.get("outcome"),
                                 "reward": t.reward, "answer": t.reward_parts.get("answer"),
                                 "text": t.assistant_texts[-1] if t.assistant_texts else ""}))
    append_line(path, "\n".join(lines))


def update_actor(actor: TrainState, actor_step, host_batch: dict, mesh, cfg: ml_collections.ConfigDict, *,
                 seed: int, step: int, guard: NonFiniteGuard | None = None) -> tuple[dict, bool]:
    """`ppo_epochs` passes of `minibatches` optimiser steps over the batch (in place on `actor`); returns the
    learner metrics averaged over the updates, and whether every update was applied: a non-finite one (which
    changed nothing) raises through `guard` or ends the step's updates (False)."""
    guard = guard or NonFiniteGuard(name="grpo")
    updates = []
    for epoch in range(cfg.ppo_epochs):
        for rows in minibatch_rows(len(host_batch["tokens"]), cfg.minibatches, seed, step, epoch):
            minibatch = batch_to_mesh({k: v[rows] for k, v in host_batch.items()}, mesh)
            actor.params, actor.opt_state, update = actor_step(actor.params, actor.frozen, actor.opt_state, minibatch)
            updates.append(fetch(update))
            if not guard.check(step, updates[-1], what=f"actor update (epoch {epoch})"):
                return {k: float(np.mean([u[k] for u in updates])) for k in LEARNER_KEYS}, False
    return {k: float(np.mean([u[k] for u in updates])) for k in LEARNER_KEYS}, True


def minibatch_rows(rows: int, minibatches: int, seed: int, step: int, epoch: int) -> list[np.ndarray]:
    """Row indices of each minibatch of one epoch: one block when `minibatches` is 1, else grain's seeded shuffle of
    the rows split into equal parts (whole rows: the seq-mean aggregations stay exact per minibatch)."""
    if minibatches == 1:
        return [np.arange(rows)]
    order = np.fromiter(grain.MapDataset.range(rows).shuffle(seed=derived_seed(seed, step, epoch)), np.int64)
    return np.split(order, minibatches)


run = run_grpo  # the pipeline's entry (config/registry.py)
