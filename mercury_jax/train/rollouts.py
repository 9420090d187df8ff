"""The rollout side of a run: episodes sampled with the weights the learner last published.

The episodes' settings and the engine's come whole (`rollout/settings.py`, built from the config by
`config/rollout.py`). With replica meshes (config `rollout.replica`, one replica's
mesh shape) the engine is a `ReplicatedEngine` over the rollout devices: R = devices / replica size replicas,
`num_slots / R` slots each, weights cast to `param_dtype` and published device to device into every replica's
layout (a replica swaps them between its requests). Without it, as follows.

Sync mode: one `Engine` on the first rollout device; `run(tasks, first_episode_id)` samples a batch with the
latest weights (episode e of the run is request block e with the run's seed, so a resumed run samples the same
tokens). Async mode: a `RolloutWorker` over the rollout devices keeps generating from a `TaskOrder` in the
background (started at the first `collect`); `collect` takes finished trajectories, dropping those more than
`max_staleness` versions old and environment failures, both counted (`train/async_batches.py`: on several processes
each rollout host samples its own share and every process agrees on each batch; a resumed run first re-samples the
episodes its checkpoint had not settled). Either way `publish(model, version)` hands new weights over and
`evaluator(seed)` gives a runner that samples held-out episodes on the shared engine with the latest weights
(`sync_engine()` first; in async mode `evaluated()` after, which frees the shared engine's weights and state until
the next evaluation, so the rollout devices hold one engine meanwhile).

Multi-process runs (docs/DESIGN.md "Multi-host") need replicas, each within one process: every process builds the
`ReplicatedEngine` over all replica meshes and drives its own, the runners are `ShardedRunner`s (episode i on the
process of replica i mod R; every process gets every trajectory), and `publish` is the collective publish every
process calls together. Async mode: every process builds the worker (the publish is collective); those with rollout
replicas run it on their own, and `AsyncBatches` assembles each batch across the hosts.

`Seams` are the parts a caller may replace (tests inject a scripted engine, a synthetic reward, a task list).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx

from mercury_jax.data.task_order import TaskOrder
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.failures import trainable
from mercury_jax.rollout.replicas import ReplicatedEngine
from mercury_jax.rollout.settings import EngineSettings, EpisodeSettings
from mercury_jax.rollout.sharded_runner import ShardedRunner
from mercury_jax.rollout.trajectory import Trajectory
from mercury_jax.rollout.worker import RolloutWorker
from mercury_jax.runs.checkpoints import Checkpointer
from mercury_jax.train.async_batches import AsyncBatches
from mercury_jax.train.placement import device_copy


@dataclasses.dataclass(frozen=True)
class Seams:
    """Injectable parts of a pipeline; None / the default: the pipeline's own."""
    make_engine: Callable = Engine             # (model, num_slots=, max_length=, policy_version=, ...) -> engine
    reward: Callable | None = None             # (task, trajectory, grade) -> (reward, parts): rollout/rewards.py
    tasks: Callable[[str], list] | None = None  # split ("train" / "eval") -> tasks, instead of config.world's
    make_checkpointer: Callable = Checkpointer  # (directory, save_every=, keep=, async_save=, layout=)


class Rollouts:
    """The run's rollout side: episodes with `settings` on the engine `engine` describes
    (`config/rollout.py:engine_settings`: the rollout devices, or replica meshes over them)."""

    def __init__(self, model: nnx.Module, tokenizer, settings: EpisodeSettings, engine: EngineSettings, *,
                 mode: str = "sync", version: int = 0, max_staleness: int = 0, queue_size: int = 64):
        if mode not in ("sync", "async"):
            raise ValueError(f"rollout.mode {mode!r} is not 'sync' or 'async'")
        self.engine_settings = dataclasses.replace(engine, max_length=engine.length(settings.budgets))
        self.devices, self.replicas = list(engine.devices), engine.replicas
        self.tokenizer, self.settings = tokenizer, settings
        self.mode, self.version, self.max_staleness, self.queue_size = mode, version, max_staleness, queue_size
        if jax.process_count() > 1 and self.replicas is None:
            raise ValueError("a multi-process run samples on rollout replicas, each within one host; set "
                             "rollout.replica (e.g. {'tensor': 4} on v5p, whose hosts have 4 chips)")
        self.replica_owners = ([int(m.devices.flat[0].process_index) for m in self.replicas]
                               if self.replicas is not None else [])
        if self.replicas is None:
            self.engine = engine.make_engine(device_copy(model, self.devices[0]), num_slots=engine.num_slots,
                                             max_length=self.engine_settings.max_length, policy_version=version)
        else:
            self.engine = ReplicatedEngine(model, self.engine_settings, policy_version=version)
        self.runner = self.evaluator(settings.sampling.seed)
        self.worker: RolloutWorker | None = None
        self.batches: AsyncBatches | None = None  # async mode: the batch assembly (train/async_batches.py)
        self._restored_meta: dict = {}
        self._usage_mark: tuple | None = None
        self._latest = model  # the learner's model: the worker starts from it, evaluations sync the engine to it

    def evaluator(self, seed: int, settings: EpisodeSettings | None = None) -> EpisodeRunner:
        """A runner on the shared engine with its own sampling seed (and, given, its own episode settings)."""
        runner = EpisodeRunner(self.engine, self.tokenizer, (settings or self.settings).with_seed(seed))
        return ShardedRunner(runner, self.replica_owners) if jax.process_count() > 1 else runner

    def run(self, tasks: list, *, first_episode_id: int) -> list[Trajectory]:
        """Sync: one episode per task with the latest weights (episode ids from `first_episode_id`)."""
        return self.runner.run(tasks, first_episode_id=first_episode_id)

    def collect(self, stream: TaskOrder, n: int) -> tuple[list[Trajectory], int, int]:
        """(n or fewer trajectories to learn from, dropped as stale, dropped for an environment failure). Sync: the
        next n tasks of `stream`, minus environment failures; async: waits for n trainable, fresh ones (every
        process together, `AsyncBatches.collect`)."""
        if self.mode == "sync":
            first = stream.consumed
            kept, env_dropped = trainable(self.run(stream.take(n), first_episode_id=first))
            if not kept:
                raise RuntimeError(f"every one of the {n} episodes of this batch had an environment failure "
                                   f"(failures: {list(self.runner.failures)[-3:]}); check the MCP servers")
            return kept, 0, env_dropped
        if self.batches is None:
            self.batches = AsyncBatches(stream, self.replica_owners, max_staleness=self.max_staleness)
            self.batches.restore(self._restored_meta)
            replicated = self.replicas is not None
            self.worker = RolloutWorker(
                self._latest if replicated else device_copy(self._latest, self.devices[0]), self.tokenizer,
                self.batches.tasks(), self.settings, self.engine_settings, numbered=True, queue_failures=True,
                policy_version=self.version, queue_size=self.queue_size,  # how far rollouts run ahead of the learner
                copy_model=False)
            self.batches.start(self.worker)
            self.engine.offload()  # the worker's engine samples now; the shared one is loaded per evaluation
        return self.batches.collect(n, self.version)

    def accounting(self) -> dict:
        """Async mode: episodes handed out so far (over the run) and those not yet trained on or dropped."""
        if self.batches is None:
            return {}
        return {"episodes_handed_out": self.batches.handed_out, "episodes_unsettled": len(self.batches.unsettled)}

    def mark_usage(self) -> None:
        """Start a reading of the rollout engine's use (`usage`), e.g. at the start of a learner step."""
        self._usage_mark = self._usage_reading()

    def usage(self) -> dict:
        """This process's rollout engine since `mark_usage`: `rollout_busy_s`, the seconds it spent in decode chunks
        and prefills (the rest of the interval it idled), and `slot_occupancy`, busy slot-steps / all slot-steps of
        its decode chunks (a slot idles when its episode ended or waits on a tool; it depends on when tool calls return,
        so a resumed run need not repeat it). In async mode the worker's engine, which samples throughout."""
        reading = self._usage_reading()
        if reading is None:
            return {}
        engine, seconds, busy, slot_steps = reading
        if self._usage_mark is not None and self._usage_mark[0] is engine:  # else the worker started meanwhile
            seconds, busy, slot_steps = (seconds - self._usage_mark[1], busy - self._usage_mark[2],
                                         slot_steps - self._usage_mark[3])
        return {"rollout_busy_s": seconds, "slot_occupancy": busy / slot_steps if slot_steps else 0.0}

    def _usage_reading(self) -> tuple:
        engine = self.worker.engine if self.worker is not None else self.engine
        if not hasattr(engine, "stats"):  # an injected engine (Seams.make_engine) need not count
            return None
        stats = engine.stats()
        return engine, stats["seconds"], stats["busy_slot_steps"], stats["slot_steps"]

    def meta(self) -> dict:
        """Async mode: the batch assembly's checkpointed state (which episodes are settled); nothing in sync mode."""
        return self.batches.meta() if self.batches is not None else dict(self._restored_meta)

    def restore(self, meta: dict) -> None:
        """Async mode: taken up when the batch assembly starts (the first `collect`)."""
        self._restored_meta = {k: v for k, v in meta.items() if k == "async_rollouts"}

    def publish(self, model: nnx.Module, version: int) -> None:
        """New weights: copied onto the rollout devices before this returns (the learner may donate its arrays)."""
        self._latest, self.version = model, version
        if self.worker is None:
            self.engine.update_weights(self._on_rollout_devices(model), version)
        else:
            self.worker.publish(nnx.state(model), version)

    def sync_engine(self) -> None:
        """Async mode: the worker holds the live weights; bring the shared engine up to date (before evaluating)."""
        if self.engine.policy_version != self.version:
            self.engine.update_weights(self._on_rollout_devices(self._latest), self.version)

    def evaluated(self) -> None:
        """After an evaluation on the shared engine: in async mode its weights and decode state are freed again, so
        the rollout devices hold one engine (the worker's) between evaluations, two only while one runs."""
        if self.worker is not None:
            self.engine.offload()

    def _on_rollout_devices(self, model: nnx.Module):
        """What the engine's `update_weights` takes: replicas cast and move the weights themselves (device to
        device); the single engine takes a copy on the first rollout device."""
        return model if self.replicas is not None else device_copy(model, self.devices[0])

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def stop_after_error(self) -> None:
        """`stop` while another exception is on its way out (the worker's own error would mask that one)."""
        try:
            self.stop()
        except Exception as error:  # noqa: BLE001
            print(f"rollout worker stopped with {type(error).__name__}: {error}", flush=True)
