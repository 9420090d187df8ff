"""The pivot-GRPO trainer: pivot states -> K continuations each -> stop-verifier rewards -> group advantages ->
clipped surrogate + k3 KL to the frozen reference -> new weights to the rollout engine -> a checkpoint every step
(docs/ALGORITHMS.md, pipeline 2; the per-step math is in `grpo_learner.py`).

One step takes `batch_states` pivot states (a seeded order over the dataset, reshuffled each pass; the state of
the order is the number of states handed out, so a resumed run continues with the same states), renders each
prefix with its task's tools into prompt ids ending in the next assistant turn's generation prompt, and submits
`group_size` requests per state to the `Engine` (one turn: stop at `<|im_end|>`, at most `max_turn_tokens`).
Continuation k of the n-th state of the run is request n * K + k with the run's seed, so its tokens depend only
on the weights. Each decoded turn is scored by `verify_stop` (a turn cut off by `max_turn_tokens` is `malformed`);
rewards [G, K] give `group_advantages` (std normalisation switchable); all-equal groups are always counted and,
with `filter_zero_variance`, dropped (their rows get an empty action mask). The frozen reference (the starting
policy in `reference_dtype`, on the actor's mesh with the actor's shardings, never updated) scores the batch,
then `ppo_epochs` x `minibatches` actor updates run and the new weights go to the engine (version += 1).

Checkpoints `workdir/grpo/checkpoints/STEP` hold `{"actor": actor.arrays()}` (params, frozen, opt_state) and
meta {step, version, states_consumed}; step 0 is the starting policy, saved before the first update (the
checkpoint sweep compares every step against it). A rerun with the same workdir resumes from the latest one.
A non-finite update raises `NonFiniteError` naming the step before anything of it is saved, or with
`train.nonfinite="skip"` ends the step's updates (no new version); SIGTERM checkpoints the step (`preemption.py`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mercury_jax.envs.browse.stop_verifier import STOP_RULES, verify_stop
from mercury_jax.parallel import shard_params
from mercury_jax.rl.advantages import group_advantages
from mercury_jax.rollout.engine import Engine, Request, Sample
from mercury_jax.rollout.episode import EpisodeRunner, decode_known
from mercury_jax.train import preemption, setup
from mercury_jax.train.checkpoints import Checkpointer
from mercury_jax.train.grpo_learner import frozen_reference, make_grpo_step, make_reference_logprobs
from mercury_jax.train.guards import NonFiniteGuard
from mercury_jax.train.metrics import MetricsLogger
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.pivot_data import build_pivots, prompt_ids, read_pivots, task_tool_schemas
from mercury_jax.train.placement import batch_to_mesh, device_copy, group_meshes, onto_mesh, shardings_of
from mercury_jax.train.resume import truncate_jsonl
from mercury_jax.train.sao import TaskStream
from mercury_jax.train.state import TrainState
from mercury_jax.train.warm_start import prepare_sft_data, run_sft_pipeline

PROGRESS = ("reward", "outcome_correct_stop", "over_search_rate", "zero_variance_fraction", "kl", "clip_fraction")
LEARNER_KEYS = ("loss", "policy_loss", "kl_loss", "kl", "clip_fraction", "clip_low_fraction", "clip_high_fraction",
                "mean_ratio", "grad_norm", "logp_train_rollout_gap")


def run_grpo(config: ml_collections.ConfigDict, workdir: Path):
    """Train the policy with pivot GRPO; returns (actor model, metric history, reference (graphdef, state))."""
    workdir = Path(workdir)
    cfg, rcfg = config.grpo, config.rollout
    model, tokenizer = starting_policy(config, workdir)
    meshes = group_meshes(config.devices, ("rollout", "actor"))
    rollout_device = meshes["rollout"].devices.flat[0]
    shard_params(model, meshes["actor"])
    reference_graphdef, reference_state = frozen_reference(model, jnp.dtype(cfg.reference_dtype))
    reference_logprobs = make_reference_logprobs(reference_graphdef)
    actor = TrainState.create(model, make_optimizer(cfg.actor_optimizer))
    actor.frozen, actor.opt_state = onto_mesh((actor.frozen, actor.opt_state), meshes["actor"])
    actor_step = make_grpo_step(actor.graphdef, actor.tx, cfg,
                                state_shardings=shardings_of((actor.params, actor.opt_state)))

    def rollout_model():
        """A copy of the actor's weights on the rollout device."""
        return device_copy(actor.model(), rollout_device)

    engine = Engine(rollout_model(), num_slots=rcfg.num_slots, max_length=rcfg.max_total_tokens, policy_version=0)
    states = pivot_states(config, workdir, tokenizer, engine)

    checkpointer = Checkpointer(workdir / "grpo" / "checkpoints", save_every=config.checkpoint.every,
                                keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    start, version, consumed = 0, 0, 0
    latest = checkpointer.latest_step()
    if latest is None:
        checkpointer.save(0, {"actor": actor.arrays()}, {"step": 0, "version": 0, "states_consumed": 0})
    else:
        arrays, meta = checkpointer.restore(latest, {"actor": actor.arrays()})
        actor = actor.replace_arrays(arrays["actor"])
        start, version, consumed = meta["step"], meta["version"], meta["states_consumed"]
        engine.update_weights(rollout_model(), version)
        print(f"[grpo] resumed from step {start} (policy version {version}, {consumed} states consumed)", flush=True)
    stream = TaskStream(states, config.seed, consumed)
    length = batch_length(states, rcfg)
    rules = dict(STOP_RULES, **cfg.stop_rules.to_dict())

    logger = MetricsLogger(workdir / "grpo", total_steps=cfg.steps, name="grpo", window=cfg.log_window)
    logger.truncate(start)
    truncate_jsonl(workdir / "grpo" / "samples.jsonl", start)
    guard = NonFiniteGuard.from_config(config.get("train"), name="grpo", history=logger.history)
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            batch_states = stream.take(cfg.batch_states)
            samples = sample_continuations(engine, batch_states, stream.consumed - len(batch_states), cfg.group_size,
                                           rcfg, tokenizer, seed=config.seed)
            rollout_s = time.perf_counter() - t0
            scores = [[score_continuation(state, sample, tokenizer, rules) for sample in group]
                      for state, group in zip(batch_states, samples)]
            rewards_GxK = np.array([[s["reward"] for s in group] for group in scores], np.float32)
            advantages_GxK, group_stats = group_advantages(rewards_GxK, std_normalize=cfg.std_normalize,
                                                           return_stats=True)
            keep_G = np.ones(len(batch_states), bool)
            if cfg.filter_zero_variance:
                keep_G = np.asarray(group_stats["keep"])
            host_batch = continuation_batch(batch_states, samples, np.asarray(advantages_GxK), keep_G, length,
                                            pad_id=tokenizer.pad_id)
            metrics = {**outcome_metrics(batch_states, scores, samples),
                       "zero_variance_fraction": float(group_stats["zero_variance_fraction"]),
                       "num_zero_variance": int(group_stats["num_zero_variance"]), "groups_kept": int(keep_G.sum()),
                       "advantage_abs_mean": float(np.abs(advantages_GxK).mean())}
            t1 = time.perf_counter()
            if keep_G.any():
                host_batch["ref_logprobs"] = np.asarray(jax.device_get(reference_logprobs(
                    reference_state, batch_to_mesh({"tokens": host_batch["tokens"]}, meshes["actor"])["tokens"])))
                reference_s = time.perf_counter() - t1
                learner_metrics, applied = update_actor(actor, actor_step, host_batch, meshes["actor"], cfg,
                                                        seed=config.seed, step=step, guard=guard)
                metrics.update(learner_metrics)
                if applied:
                    version += 1
                    engine.update_weights(rollout_model(), version)
            else:  # nothing to learn from (every group filtered): no optimiser step, so Adam's momentum cannot move us
                reference_s = 0.0
                print(f"[grpo] step {step}: every group has zero reward variance; update skipped", flush=True)
            step_s = time.perf_counter() - t0
            all_tokens = int(sum(len(s["prompt_ids"]) + len(c.tokens)
                                 for s, g in zip(batch_states, samples) for c in g))
            generated = int(sum(len(c.tokens) for g in samples for c in g))
            metrics.update(update_skipped=int(not keep_G.any()), nonfinite_skipped=guard.skipped,
                           policy_version=version, states_consumed=stream.consumed, tokens_per_s=all_tokens / step_s,
                           generated_tokens_per_s=generated / max(rollout_s, 1e-9), rollout_s=rollout_s,
                           reference_s=reference_s, learner_s=time.perf_counter() - t1 - reference_s,
                           batch_length=length, step_time_s=step_s)
            logger.log(step, metrics, progress_keys=PROGRESS)
            write_samples(workdir / "grpo" / "samples.jsonl", step, batch_states, samples, scores, tokenizer)
            if checkpointer.should_save(step, last=step == cfg.steps):
                checkpointer.save(step, {"actor": actor.arrays()},
                                  {"step": step, "version": version, "states_consumed": stream.consumed})
            preemption.exit_if_requested(step, "grpo", checkpointer)
    except BaseException:  # a non-finite step, a preemption, a failure: the last good save still gets committed
        checkpointer.close_after_error()
        raise
    checkpointer.close()
    logger.plot(["reward", "outcome_correct_stop", "over_search_rate", "stop_rate_sufficient", "premature_rate",
                 "zero_variance_fraction", "kl", "clip_fraction", "grad_norm"], "grpo_curves.png")
    logger.close()
    if logger.history:
        (workdir / "grpo" / "summary.json").write_text(json.dumps(
            {"first": logger.history[0], "last": logger.history[-1], "steps": cfg.steps}, indent=2))
    return actor.model(), logger.history, (reference_graphdef, reference_state)


# ------------------------------------------------------------------------------------------------ set-up
def starting_policy(config: ml_collections.ConfigDict, workdir: Path):
    """(policy, tokenizer): the SFT warm start when `sft.enabled` (tiny demo), else `model.hf_path` / the preset."""
    if config.sft.enabled:
        return run_sft_pipeline(config, workdir)
    if config.tokenizer.kind == "sentencepiece":  # trained on (cached under) the same oracle text as a warm start
        tokenizer, _ = prepare_sft_data(config, workdir)
    else:
        tokenizer = setup.build_tokenizer(config.tokenizer, workdir, [])
    return setup.build_model(config.model, tokenizer.vocab_size, config.seed), tokenizer


def starting_policy_name(config: ml_collections.ConfigDict) -> str:
    """Which policy GRPO starts from (the pivot dataset's provenance)."""
    if config.sft.enabled:
        return f"sft warm start ({config.sft.steps} steps, seed {config.seed})"
    return config.model.hf_path or f"{config.model.preset} preset, untrained (seed {config.seed})"


def pivot_states(config: ml_collections.ConfigDict, workdir: Path, tokenizer, engine: Engine) -> list[dict]:
    """The pivot dataset (built first if missing) as states {record, task, prefix, tools, prompt_ids}, without
    those whose prompt leaves fewer than `max_turn_tokens` under `max_total_tokens`."""
    cfg, rcfg = config.grpo, config.rollout
    path = Path(cfg.pivots_path) if cfg.pivots_path else workdir / "grpo" / "pivots.jsonl"
    if not path.exists():
        tasks = setup.world_tasks(pivot_world(config), "train")
        run_episodes = None
        if cfg.pivot_source == "policy":
            runner = EpisodeRunner(engine, tokenizer, budgets=setup.rollout_budgets(rcfg),
                                   behaviour=setup.behaviour(config),
                                   sampling=setup.rollout_sampling(rcfg, config.seed + 2_000_003))
            run_episodes = runner.run
        t0 = time.perf_counter()
        counts = build_pivots(tasks, path, source=cfg.pivot_source, oracle_options=config.oracle.to_dict(),
                              run_episodes=run_episodes, kinds=tuple(cfg.pivot_kinds),
                              policy_version=starting_policy_name(config) if cfg.pivot_source == "policy" else None)
        print(f"[grpo] pivot dataset {path}: {counts['pivots']} states ({counts['sufficient']} with sufficient "
              f"evidence) from {counts['tasks_with_pivots']}/{counts['tasks']} {cfg.pivot_source} trajectories "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    records = read_pivots(path)
    tools = task_tool_schemas([r["task"] for r in records])
    budget = rcfg.max_total_tokens - rcfg.max_turn_tokens
    states, too_long = [], 0
    for record, task_tools in zip(records, tools):
        ids = prompt_ids(tokenizer, record["prefix"], task_tools)
        if len(ids) > budget:
            too_long += 1
            continue
        states.append({"record": record, "task": record["task"], "prefix": record["prefix"], "tools": task_tools,
                       "prompt_ids": ids})
    if not records:
        raise ValueError(f"pivot dataset {path} holds no states: no {cfg.pivot_source} trajectory reached a stop "
                         f"decision (evidence became sufficient); start from a stronger policy, raise "
                         f"grpo.pivot_tasks, or use grpo.pivot_source='oracle' (and delete the empty file)")
    if not states:
        raise ValueError(f"no pivot state of {path} fits: every prompt is longer than rollout.max_total_tokens - "
                         f"rollout.max_turn_tokens = {budget}; raise rollout.max_total_tokens")
    lengths = [len(s["prompt_ids"]) for s in states]
    print(f"[grpo] {len(states)} pivot states ({sum(s['record']['evidence_sufficient'] for s in states)} sufficient; "
          f"{too_long} dropped as too long), prompts {min(lengths)}-{max(lengths)} tokens", flush=True)
    return states


def pivot_world(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The world config of the pivot tasks: the train split at `grpo.pivot_task_seed` (disjoint from the warm
    start's tasks) with `grpo.pivot_tasks` tasks; a corpus directory's train slice is used as it is."""
    world = ml_collections.ConfigDict(config.world.to_dict())
    world.train_seed, world.num_train_tasks = config.grpo.pivot_task_seed, config.grpo.pivot_tasks
    return world


def batch_length(states: list[dict], rcfg: ml_collections.ConfigDict) -> int:
    """Pad length of every batch: the longest prompt + `max_turn_tokens`, rounded up to 128 (one compiled shape
    per learner function for the whole run)."""
    longest = max(len(s["prompt_ids"]) for s in states) + rcfg.max_turn_tokens
    return min(-(-longest // 128) * 128, max(rcfg.max_total_tokens, longest))


# ------------------------------------------------------------------------------------------------ one step
def sample_continuations(engine: Engine, states: list[dict], first_index: int, group_size: int,
                         rcfg: ml_collections.ConfigDict, tokenizer, *, seed: int) -> list[list[Sample]]:
    """K one-turn continuations of each state ([G][K] samples); state n of the run, sample k is request n*K + k."""
    for i, state in enumerate(states):
        for k in range(group_size):
            engine.submit(Request((first_index + i) * group_size + k, state["prompt_ids"],
                                  max_new_tokens=rcfg.max_turn_tokens, temperature=rcfg.temperature,
                                  top_p=rcfg.top_p, seed=seed, stop_token_ids=tuple(tokenizer.stop_token_ids)))
    engine.run()
    return [[engine.forget((first_index + i) * group_size + k) for k in range(group_size)]
            for i in range(len(states))]


def score_continuation(state: dict, sample: Sample, tokenizer, rules: dict) -> dict:
    """The stop-verifier's verdict on one sampled turn; a turn cut off before its stop token (or holding ids the
    tokenizer cannot decode) is `malformed` whatever its text."""
    text, unknown = decode_known(tokenizer, sample.tokens)
    verdict = verify_stop(state["task"], state["prefix"], text, tools=state["tools"], rules=rules)
    cut_off = sample.finish_reason != "stop"
    if cut_off or unknown:
        verdict = {**verdict, "outcome": "malformed", "reward": rules["malformed"]}
    return {**verdict, "cut_off": cut_off}


def continuation_batch(states: list[dict], samples: list[list[Sample]], advantages_GxK: np.ndarray,
                       keep_G: np.ndarray, length: int, *, pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded [G*K, length] arrays, row g*K + k = prompt of state g + its k-th continuation: tokens (int32),
    action_mask (1 on the sampled tokens of kept groups), rollout_logprobs, advantages (A[g, k] on action tokens)."""
    rows = sum(len(group) for group in samples)
    batch = {"tokens": np.full((rows, length), pad_id, np.int32),
             "action_mask": np.zeros((rows, length), np.float32),
             "rollout_logprobs": np.zeros((rows, length), np.float32),
             "advantages": np.zeros((rows, length), np.float32)}
    row = 0
    for g, (state, group) in enumerate(zip(states, samples)):
        for k, sample in enumerate(group):
            prompt, end = len(state["prompt_ids"]), len(state["prompt_ids"]) + len(sample.tokens)
            if end > length:
                raise ValueError(f"continuation row of {end} tokens exceeds the batch length {length}")
            batch["tokens"][row, :prompt] = state["prompt_ids"]
            batch["tokens"][row, prompt:end] = sample.tokens
            batch["action_mask"][row, prompt:end] = float(keep_G[g])
            batch["rollout_logprobs"][row, prompt:end] = sample.logprobs
            batch["advantages"][row, prompt:end] = advantages_GxK[g, k] * float(keep_G[g])
            row += 1
    return batch


def outcome_metrics(states: list[dict], scores: list[list[dict]], samples: list[list[Sample]]) -> dict:
    """Reward, the fraction of each verifier outcome, and the stop behaviour split by the state's label:
    stop_rate_sufficient (answers at sufficient states), over_search_rate (tool calls at sufficient states),
    premature_rate (answers at insufficient states); plus cut-off rate and response length."""
    flat = [s for group in scores for s in group]
    rewards = np.array([s["reward"] for s in flat])
    sufficient = [s for s in flat if s["evidence_sufficient"]]
    insufficient = [s for s in flat if not s["evidence_sufficient"]]

    def rate(items, outcomes):
        return float(np.mean([s["outcome"] in outcomes for s in items])) if items else None  # null: no such state

    metrics = {"reward": float(rewards.mean()), "reward_std": float(rewards.std())}
    metrics.update({f"outcome_{name}": rate(flat, (name,)) for name in STOP_RULES})
    metrics.update(stop_rate_sufficient=rate(sufficient, ("correct_stop", "ungrounded", "wrong")),
                   over_search_rate=rate(sufficient, ("over_search",)),
                   premature_rate=rate(insufficient, ("premature",)),
                   sufficient_state_fraction=float(np.mean([s["record"]["evidence_sufficient"] for s in states])),
                   cut_off_rate=float(np.mean([s["cut_off"] for s in flat])),
                   response_length=float(np.mean([len(c.tokens) for group in samples for c in group])))
    return metrics


def write_samples(path: Path, step: int, states: list[dict], samples: list[list[Sample]], scores: list[list[dict]],
                  tokenizer) -> None:
    """Append every continuation of the step (state, decoded text, verdict) to a JSONL file, for reading what the
    policy does at each kind of state."""
    with path.open("a") as f:
        for state, group, verdicts in zip(states, samples, scores):
            record = state["record"]
            for sample, verdict in zip(group, verdicts):
                f.write(json.dumps({"step": step, "task_id": record["task_id"], "kind": record["kind"],
                                    "evidence_sufficient": record["evidence_sufficient"],
                                    "gold": state["task"]["answer"], "outcome": verdict["outcome"],
                                    "reward": verdict["reward"], "answer": verdict["answer"],
                                    "text": decode_known(tokenizer, sample.tokens)[0]}) + "\n")


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
            updates.append(jax.device_get(update))
            if not guard.check(step, updates[-1], what=f"actor update (epoch {epoch})"):
                return {k: float(np.mean([u[k] for u in updates])) for k in LEARNER_KEYS}, False
    return {k: float(np.mean([u[k] for u in updates])) for k in LEARNER_KEYS}, True


def minibatch_rows(rows: int, minibatches: int, seed: int, step: int, epoch: int) -> list[np.ndarray]:
    """Row indices of each minibatch of one epoch: one block when `minibatches` is 1, else a seeded permutation
    split into equal parts (whole rows: the seq-mean aggregations stay exact per minibatch)."""
    if minibatches == 1:
        return [np.arange(rows)]
    order = np.random.default_rng([seed, step, epoch]).permutation(rows)
    return np.split(order, minibatches)
