"""The SAO trainer: rollouts -> critic values -> skip-observation GAE -> K critic updates -> one DIS policy update
-> publish weights (docs/ALGORITHMS.md, pipeline 1; the per-step math is in `sao_learner.py`).

Device groups come from `config.devices` (rollout / actor / critic; all 0 = one shared device): the actor and the
critic each live on their own mesh (batch sharded over it), the rollout engine on the first rollout device with
a copy of the actor's weights that is replaced after every policy update (version = policy updates so far).
`rollout.mode = "sync"` samples every batch with the latest weights, episode e of the run always being request
block e with the run's seed, so a killed run resumes bit-for-bit; `"async"` runs the `RolloutWorker` in the
background (no barrier: it keeps generating while the learner trains), takes the next `batch_prompts` finished
trajectories, drops those more than `sao.max_staleness` versions old (counted in `dropped_stale`), and publishes
new weights into the running worker. An async resume restarts from the tasks handed out at the checkpoint
(episodes in flight then are not replayed), so it is not bit-exact.

A non-finite critic or actor update raises `NonFiniteError` naming the step (or, with `train.nonfinite="skip"`,
skips the rest of the step: no publish, no version); a SIGTERM checkpoints the step and exits (`preemption.py`);
a resume drops the held-out rows written after its checkpoint (`resume.py`), so none is logged twice.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from flax import nnx

from mercury_jax.evaluation import discordant_counts, paired_difference, sign_test
from mercury_jax.parallel import shard_params
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.failures import trainable
from mercury_jax.rollout.trajectory import Trajectory, batch_trajectories
from mercury_jax.rollout.worker import RolloutWorker
from mercury_jax.train import preemption, setup
from mercury_jax.train.checkpoints import Checkpointer
from mercury_jax.train.guards import NonFiniteGuard
from mercury_jax.train.metrics import MetricsLogger, plot_evaluations
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.placement import batch_to_mesh, device_copy, group_meshes, onto_mesh, shardings_of
from mercury_jax.train.resume import read_jsonl, truncate_jsonl
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step
from mercury_jax.train.sft import epoch_order
from mercury_jax.train.state import TrainState
from mercury_jax.train.warm_start import prepare_sft_data, run_sft_pipeline
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable

PROGRESS = ("reward", "all_effects_pass", "truncation_rate", "value_loss", "dis_masked_fraction")


class TaskStream:
    """Train tasks in a seeded order, reshuffled each epoch; its state is the number of tasks handed out."""
    def __init__(self, tasks: list[dict], seed: int, consumed: int = 0):
        self.tasks, self.seed, self.consumed = tasks, seed, consumed

    def take(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, index = divmod(self.consumed, len(self.tasks))
            order = epoch_order(len(self.tasks), self.seed, epoch)
            out.append(self.tasks[order[index]])
            self.consumed += 1
        return out


def trajectory_metrics(trajectories: list[Trajectory]) -> dict:
    """The released run's table for one batch: reward, all-effects pass, degenerate and truncation rates,
    mean raw response length (action tokens), plus format errors and staleness inputs."""
    reward = np.array([t.reward for t in trajectories])
    return {
        "reward": float(reward.mean()),
        "reward_std": float(reward.std()),
        "effects_fraction": float(np.mean([t.reward_parts.get("effects_fraction", 0.0) for t in trajectories])),
        "all_effects_pass": float(np.mean([bool(t.reward_parts.get("all_effects_pass")) for t in trajectories])),
        "degenerate_rate": float(np.mean([t.finish_reason == "degenerate" for t in trajectories])),
        "truncation_rate": float(np.mean([t.finish_reason in ("token_budget", "degenerate", "turn_budget")
                                          for t in trajectories])),
        "response_length": float(np.mean([t.num_action_tokens for t in trajectories])),
        "format_errors": float(np.mean([len(t.format_errors) for t in trajectories])),
        "tool_calls": float(np.mean([len(t.tool_calls) for t in trajectories])),
    }


def write_eval_summary(evals: list[dict], out: Path) -> dict | None:
    """Compare the last held-out evaluation with the first (the warm start's), paired task by task (the same tasks
    and sampling seeds at every evaluation, so per-task difficulty cancels); print it and write it as JSON."""

    if len(evals) < 2 or "task_all_effects_pass" not in evals[0] or evals[0]["task_ids"] != evals[-1]["task_ids"]:
        return None
    first, last = evals[0], evals[-1]
    paired = paired_difference(first["task_rewards"], last["task_rewards"])
    passed_before, passed_after = first["task_all_effects_pass"], last["task_all_effects_pass"]
    lost, gained = discordant_counts(passed_before, passed_after)
    passes = {"start": sum(passed_before) / len(passed_before), "end": sum(passed_after) / len(passed_after),
              "gained": gained, "lost": lost, "p_mcnemar_greater": sign_test(gained, lost, "greater")}
    summary = {"start": {k: first[k] for k in ("step", "label", "reward", "reward_sem")},
               "end": {k: last[k] for k in ("step", "label", "reward", "reward_sem")}, "paired": paired,
               "all_effects_pass": passes}
    out.write_text(json.dumps(summary, indent=1) + "\n")
    low, high = paired["ci"]
    print(f"[sao] held-out reward {paired['start_mean']:.3f} ({first['label']}) -> {paired['candidate_mean']:.3f} "
          f"({last['label']}): paired difference {paired['mean_difference']:+.3f} +- {paired['sem']:.3f} (sem), "
          f"{paired['confidence']:.0%} CI [{low:+.3f}, {high:+.3f}], paired t p = {paired['p_paired_t']:.2g}; "
          f"{paired['wins']} tasks better, {paired['losses']} worse, {paired['ties']} equal (sign test p = "
          f"{paired['p_sign_greater']:.2g}) over {paired['num_tasks']} tasks; all-effects pass {passes['start']:.3f} "
          f"-> {passes['end']:.3f} ({gained} tasks gained, {lost} lost, McNemar p = "
          f"{passes['p_mcnemar_greater']:.2g})", flush=True)
    return summary


def _batch_length(trajectories: list[Trajectory], limit: int) -> int:
    """Pad length: the longest trajectory rounded up to a bucket (128 tokens for budgets up to 4,096, else 2,048),
    at most the budget rounded up. Each bucket is one compiled shape of the learner functions, so a run compiles a
    few of them and then pays only for the tokens its batches hold (short episodes are not padded to the budget)."""
    bucket = 128 if limit <= 4096 else 2048
    ceiling = -(-limit // bucket) * bucket
    return min(-(-max(len(t.tokens) for t in trajectories) // bucket) * bucket, ceiling)


def _stop_quietly(worker: RolloutWorker) -> None:
    """Stop the rollout worker while another exception is on its way out (its own error would mask that one)."""
    try:
        worker.stop(timeout=60)
    except Exception as error:  # noqa: BLE001
        print(f"[sao] rollout worker stopped with {type(error).__name__}: {error}", flush=True)


def run_sao(config: ml_collections.ConfigDict, workdir: Path):
    workdir = Path(workdir)
    if config.sft.enabled:
        model, tokenizer = run_sft_pipeline(config, workdir)
    else:
        tokenizer, _ = prepare_sft_data(config, workdir)
        model = setup.build_model(config.model, tokenizer.vocab_size, config.seed)
    cfg, rcfg = config.sao, config.rollout
    meshes = group_meshes(config.devices, ("rollout", "actor", "critic"))
    rollout_device = meshes["rollout"].devices.flat[0]

    critic = Qwen35MoeCritic.from_policy(model)
    shard_params(model, meshes["actor"])
    shard_params(critic, meshes["critic"])
    actor = TrainState.create(model, make_optimizer(cfg.actor_optimizer))
    critic_state = TrainState.create(critic, make_optimizer(cfg.critic_optimizer), critic_trainable)
    # before a restore commits them to device 0
    actor.frozen, actor.opt_state = onto_mesh((actor.frozen, actor.opt_state), meshes["actor"])
    critic_state.frozen, critic_state.opt_state = onto_mesh((critic_state.frozen, critic_state.opt_state),
                                                            meshes["critic"])
    actor_step = make_actor_step(actor.graphdef, actor.tx, cfg,
                                 state_shardings=shardings_of((actor.params, actor.opt_state)))
    critic_step = make_critic_step(critic_state.graphdef, critic_state.tx, cfg,
                                   state_shardings=shardings_of((critic_state.params, critic_state.opt_state)))
    advantage_fn = make_advantage_fn(critic_state.graphdef, cfg)

    train_tasks = setup.world_tasks(config.world, "train")
    eval_tasks = setup.world_tasks(config.world, "eval")
    checkpointer = Checkpointer(workdir / "sao" / "checkpoints", save_every=config.checkpoint.every,
                                keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    start, version, consumed = 0, 0, 0
    latest = checkpointer.latest_step()
    if latest is not None:
        arrays, meta = checkpointer.restore(latest, {"actor": actor.arrays(), "critic": critic_state.arrays()})
        actor, critic_state = actor.replace_arrays(arrays["actor"]), critic_state.replace_arrays(arrays["critic"])
        start, version, consumed = meta["step"], meta["version"], meta["tasks_consumed"]
        print(f"[sao] resumed from step {start} (policy version {version}, {consumed} tasks consumed)", flush=True)
    stream = TaskStream(train_tasks, config.seed, consumed)

    def rollout_model():
        """A copy of the actor's weights on the rollout device."""
        return device_copy(actor.model(), rollout_device)

    engine = Engine(rollout_model(), num_slots=rcfg.num_slots, max_length=rcfg.max_total_tokens,
                    policy_version=version)
    budgets, behaviour = setup.rollout_budgets(rcfg), setup.behaviour(config)
    train_runner = EpisodeRunner(engine, tokenizer, budgets=budgets, behaviour=behaviour,
                                 sampling=setup.rollout_sampling(rcfg, config.seed))
    eval_runner = EpisodeRunner(engine, tokenizer, budgets=budgets, behaviour=behaviour,
                                sampling=setup.rollout_sampling(rcfg, config.seed + 1_000_003))

    def evaluate(label: str) -> dict:
        if engine.policy_version != version:  # async mode: the worker holds the live weights
            engine.update_weights(rollout_model(), version)
        trajectories = eval_runner.run(eval_tasks)
        rewards = np.array([t.reward for t in trajectories])
        result = {"label": label, **trajectory_metrics(trajectories), "reward_sem": float(rewards.std(ddof=1) /
                                                                                        np.sqrt(len(rewards))),
                  "task_ids": [t.task_id for t in trajectories], "task_rewards": rewards.tolist(),
                  "task_all_effects_pass": [bool(t.reward_parts.get("all_effects_pass")) for t in trajectories],
                  "env_failures": sum(t.env_failure is not None for t in trajectories)}  # scored 0, kept for pairing
        print(f"[sao] eval ({label}): reward {result['reward']:.3f} +- {result['reward_sem']:.3f} (sem over "
              f"{len(rewards)} held-out tasks), all-effects pass {result['all_effects_pass']:.2f}", flush=True)
        return result

    worker = None
    if rcfg.mode == "async":
        def task_iterator():
            while True:
                yield stream.take(1)[0]
        worker = RolloutWorker(rollout_model(), tokenizer, task_iterator(), num_slots=rcfg.num_slots,
                               max_length=rcfg.max_total_tokens, budgets=budgets, behaviour=behaviour,
                               sampling=setup.rollout_sampling(rcfg, config.seed),
                               devices=list(meshes["rollout"].devices.flat), policy_version=version,
                               queue_size=cfg.batch_prompts,  # bounds how far rollouts run ahead of the learner
                               first_episode_id=stream.consumed, copy_model=False)
    elif rcfg.mode != "sync":
        raise ValueError(f"rollout.mode {rcfg.mode!r} is not 'sync' or 'async'")

    def collect(n: int) -> tuple[list[Trajectory], int, int]:
        """(trajectories to learn from, dropped as stale, dropped for an environment failure). Sync mode learns
        from the batch's surviving episodes; async mode waits for n trainable ones."""
        if worker is None:
            tasks = stream.take(n)
            kept, env_dropped = trainable(train_runner.run(tasks, first_episode_id=stream.consumed - len(tasks)))
            if not kept:
                raise RuntimeError(f"every one of the {n} episodes of this batch had an environment failure "
                                   f"(train_runner.failures: {train_runner.failures[-3:]}); check the MCP servers")
            return kept, 0, env_dropped
        kept, dropped, env_dropped = [], 0, 0
        while len(kept) < n:
            trajectory = worker.get(timeout=3600)
            if trajectory.env_failure is not None:
                env_dropped += 1
            elif version - trajectory.policy_version > cfg.max_staleness:
                dropped += 1
            else:
                kept.append(trajectory)
        return kept, dropped, env_dropped

    def publish():
        if worker is None:
            engine.update_weights(rollout_model(), version)
        else:
            worker.publish(nnx.state(actor.model()), version)

    evals_path = workdir / "sao" / "evals.jsonl"
    if start == 0:
        evals_path.parent.mkdir(parents=True, exist_ok=True)
        evals_path.write_text(json.dumps({"step": 0, **evaluate("warm start")}) + "\n")
    else:  # rows after the checkpoint (an evaluation written just before a kill) are replayed
        truncate_jsonl(evals_path, start)

    logger = MetricsLogger(workdir / "sao", total_steps=cfg.steps, name="sao", window=cfg.log_window)
    logger.truncate(start)
    guard = NonFiniteGuard.from_config(config.get("train"), name="sao", history=logger.history)
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            if worker is not None and not worker.running:
                worker.start()
            trajectories, dropped, env_dropped = collect(cfg.batch_prompts)
            rollout_s = time.perf_counter() - t0
            staleness = np.array([version - t.policy_version for t in trajectories])
            length = _batch_length(trajectories, rcfg.max_total_tokens)
            host_batch = batch_trajectories(trajectories, length, pad_id=tokenizer.pad_id)
            del host_batch["lengths"]

            critic_batch = batch_to_mesh(host_batch, meshes["critic"])
            adv, returns, values, adv_stats = advantage_fn(critic_state.params, critic_state.frozen, critic_batch)
            critic_batch.update(returns=returns, old_values=values)
            applied = True  # a non-finite critic or actor update skips the rest of the step (guards.py)
            for _ in range(cfg.critic_epochs):
                params, opt_state, critic_metrics = critic_step(critic_state.params, critic_state.frozen,
                                                                critic_state.opt_state, critic_batch)
                critic_state.params, critic_state.opt_state = params, opt_state
                critic_metrics = jax.device_get(critic_metrics)
                applied = guard.check(step, critic_metrics, what="critic update")
                if not applied:
                    break
            metrics = {**trajectory_metrics(trajectories), **jax.device_get(adv_stats),
                       "value_loss": float(critic_metrics["value_loss"]), "critic_grad_norm":
                       float(critic_metrics["grad_norm"])}
            if step > cfg.critic_only_steps and applied:
                actor_batch = batch_to_mesh({**host_batch, "advantages": np.asarray(adv)}, meshes["actor"])
                params, opt_state, actor_metrics = actor_step(actor.params, actor.frozen, actor.opt_state,
                                                              actor_batch)
                actor.params, actor.opt_state = params, opt_state
                actor_metrics = jax.device_get(actor_metrics)
                applied = guard.check(step, actor_metrics, what="actor update")
                if applied:
                    version += 1
                    publish()
                metrics.update({k: float(v) for k, v in actor_metrics.items() if k != "loss"})
            step_s = time.perf_counter() - t0
            tokens = sum(len(t.tokens) for t in trajectories)
            metrics.update(staleness_mean=float(staleness.mean()), staleness_max=int(staleness.max()),
                           dropped_stale=dropped, env_failures=env_dropped, nonfinite_skipped=guard.skipped,
                           policy_version=version, tokens_per_s=tokens / step_s, rollout_s=rollout_s,
                           learner_s=step_s - rollout_s, batch_length=length, step_time_s=step_s)
            logger.log(step, metrics, progress_keys=PROGRESS)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                with evals_path.open("a") as f:
                    f.write(json.dumps({"step": step, **evaluate(f"step {step}")}) + "\n")
            if checkpointer.should_save(step, last=step == cfg.steps):
                checkpointer.save(step, {"actor": actor.arrays(), "critic": critic_state.arrays()},
                                  {"step": step, "version": version, "tasks_consumed": stream.consumed})
            preemption.exit_if_requested(step, "sao", checkpointer)
    except BaseException:  # a non-finite step, a preemption, a failure: the worker thread must not outlive the loop
        if worker is not None:
            _stop_quietly(worker)
        checkpointer.close_after_error()  # the last good save still gets committed
        raise
    if worker is not None:
        worker.stop()
    checkpointer.close()
    evaluations = read_jsonl(evals_path)
    if not any(e["step"] == cfg.steps and e["label"] == "after SAO" for e in evaluations):
        evaluations.append({"step": cfg.steps, **evaluate("after SAO")})
        with evals_path.open("a") as f:
            f.write(json.dumps(evaluations[-1]) + "\n")
        write_eval_summary(evaluations, workdir / "sao" / "eval_summary.json")
        plot_evaluations(evaluations, workdir / "sao" / "sao_heldout.png",
                         title=f"SAO held-out evaluations ({len(eval_tasks)} tasks, the same seeds each time)")
    logger.plot(["reward", "all_effects_pass", "truncation_rate", "response_length", "value_loss",
                 "explained_variance", "dis_masked_fraction"], "sao_curves.png")
    logger.close()
    return actor.model(), critic_state.model(), logger.history
