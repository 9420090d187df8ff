"""The asynchronous rollout worker (docs/ALGORITHMS.md, SAO "Asynchrony"): episodes run continuously, and each finished
trajectory goes to the learner's queue at once (no group barrier, no waiting for the slowest episode).

    worker = RolloutWorker(model, tokenizer, tasks, EpisodeSettings(budgets=...),
                           EngineSettings(num_slots=64, devices=jax.devices()[4:]))
    worker.start()                                  # background thread: an asyncio loop driving one Engine
    trajectory = worker.get(timeout=60)             # or worker.queue.get(); raises if the worker failed
    worker.publish(nnx.state(policy, nnx.Param), version=step)   # picked up between two decode chunks
    worker.stats()                                  # tokens/s, episodes/s, slot occupancy, queue depth, ...
    worker.stop()                                   # re-raises the worker's exception, if any

The worker owns a copy of the model (placed, replicated, on the mesh of `EngineSettings.devices` when given;
`copy_model=False` hands it the model itself, e.g. one already built on its devices) and one `Engine`. With
`EngineSettings.replicas` (meshes, `layout.replica_meshes`) it runs a `ReplicatedEngine` instead: `num_slots`
split evenly over the replicas, weights cast to `param_dtype` and sharded per replica, a publish cast and moved
device to device into every replica's layout before `publish` returns, and swapped by each replica between
requests (no request mixes versions).
At most `num_slots` episodes are in flight; an episode keeps its place until its trajectory is in the (bounded)
queue, so a slow learner slows the rollouts instead of piling up finished trajectories. Published weights are
swapped in between decode chunks: in-flight episodes continue, and tokens sampled after the swap carry the new
version (`Trajectory.policy_versions`; `Trajectory.policy_version` is the oldest). Episode e (counting from
`first_episode_id`) runs on request ids e * stride + k, so given the same tasks, seed and weights an episode's
tokens do not depend on what else runs.

Tasks are numbered by episode id (from 0, or `(episode id, task)` pairs with `numbered=True`), and
every queued trajectory carries its `episode_id`. An environment that fails to open or to grade costs its episode
only: nothing is queued for it (with `queue_failures=True` its placeholder is, `env_failure` set), the failure is in
`worker.failures` and `stats()["env_failures"]`, and the worker goes on. Trajectories a tool failure touched are
queued with `env_failure` set; trainers drop them with `rollout.failures.trainable`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Iterable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.chat.tokenizer import Tokenizer
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.failures import EnvironmentFailure, EpisodeFailure
from mercury_jax.rollout.replicas import ReplicatedEngine
from mercury_jax.rollout.settings import EngineSettings, EpisodeSettings
from mercury_jax.rollout.trajectory import Trajectory


class RolloutWorker:
    """Runs episodes over `tasks` until they run out or `stop()`; pushes each trajectory to `queue` once."""

    def __init__(self, model: nnx.Module, tokenizer: Tokenizer, tasks: Iterable[Mapping],
                 settings: EpisodeSettings = EpisodeSettings(), engine: EngineSettings = EngineSettings(), *,
                 queue_size: int = 1024, policy_version: int = 0, copy_model: bool = True, numbered: bool = False,
                 queue_failures: bool = False):
        self.sharding = None
        max_length = engine.length(settings.budgets)
        if engine.replicas is not None:
            self.model = model  # each replica casts and places its own copy
            self._placement = None
            self.engine = ReplicatedEngine(model, dataclasses.replace(engine, max_length=max_length),
                                           policy_version=policy_version)
        else:
            if engine.devices is not None:
                self.sharding = NamedSharding(Mesh(np.asarray(list(engine.devices)), ("replica",)), PartitionSpec())
            self.model = nnx.clone(model) if copy_model else model  # copy_model=False: `model` is the worker's own
            if self.sharding is not None:
                nnx.update(self.model, jax.device_put(nnx.state(self.model), self.sharding))
            # where every weight lives: published weights (e.g. from the learner's mesh) are moved here on the swap
            self._placement = jax.tree.map(lambda x: x.sharding, nnx.state(self.model))
            self.engine = engine.make_engine(self.model, num_slots=engine.num_slots, max_length=max_length,
                                             steps_per_sync=engine.steps_per_sync, policy_version=policy_version)
            if self.sharding is not None:
                self.engine.state = jax.device_put(self.engine.state, self.sharding)
        self.runner = EpisodeRunner(self.engine, tokenizer, settings, before_step=self._apply_published)
        self.queue: queue.Queue[Trajectory] = queue.Queue(queue_size)
        self.num_slots = engine.num_slots
        # (episode id, task) pairs: numbered by the caller, or counted from 0
        self._tasks = iter(tasks) if numbered else enumerate(tasks)
        self.queue_failures = queue_failures
        self._published = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._in_flight = self._episodes = self._publishes = 0
        self._started_at = self._ended_at = None

    # -- control --

    def start(self) -> RolloutWorker:
        if self._thread is not None:
            raise RuntimeError("RolloutWorker.start() was already called; a worker runs once")
        self._started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._thread_main, name="rollout-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop (in-flight episodes are abandoned: they reach the queue never, not twice) and join the thread;
        re-raises the exception that ended the worker, if any."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to end (tasks exhausted and every trajectory queued, or stopped); re-raise its error."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"rollout worker still running after {timeout} s")
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout worker failed: {type(self.error).__name__}: {self.error}") from self.error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def get(self, timeout: float | None = None) -> Trajectory:
        """The next trajectory; raises the worker's error if it died, `queue.Empty` after `timeout` seconds, or
        RuntimeError when the worker ended and the queue is empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.queue.get(timeout=0.05)
            except queue.Empty:
                self.raise_if_failed()
                if self._thread is not None and not self._thread.is_alive() and self.queue.empty():
                    raise RuntimeError("rollout worker has ended (tasks exhausted or stopped) and its queue is "
                                       "empty") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise

    def publish(self, params_state, version: int) -> None:
        """New weights (an `nnx.State` of the model or of its params, or a model of the same structure) for tokens
        sampled from the next decode chunk on. Thread-safe; a later publish before the swap replaces this one.

        The worker takes its own copy, placed where its weights live, before this returns (never an alias, even
        on a shared device): the caller may donate or delete the arrays it passed right away, e.g. the learner's
        next step donating its parameters while the swap still waits for the end of a decode chunk."""
        if isinstance(params_state, nnx.Module):
            params_state = nnx.state(params_state)
        if self._placement is None:  # replicas: cast and moved into every replica's layout now
            prepared = self.engine.prepare_weights(params_state)
            with self._lock:
                self._published = (prepared, int(version))
            return
        placement = dict(jax.tree_util.tree_flatten_with_path(self._placement)[0])
        paths, treedef = jax.tree_util.tree_flatten_with_path(params_state)
        unknown = [jax.tree_util.keystr(path) for path, _ in paths if path not in placement]
        if unknown:
            raise ValueError(f"published weights hold {', '.join(unknown[:3])} ({len(unknown)} in all), which the "
                             f"worker's model does not have; publish nnx.state(model) or nnx.state(model, nnx.Param) "
                             f"of a model with the worker's structure")
        shardings = jax.tree_util.tree_unflatten(treedef, [placement[path] for path, _ in paths])
        owned = jax.device_put(params_state, shardings, may_alias=False)
        with self._lock:
            self._published = (owned, int(version))

    def stats(self) -> dict:
        engine = self.engine.stats()
        end = self._ended_at or time.perf_counter()
        elapsed = end - self._started_at if self._started_at else 0.0
        rate = lambda n: n / elapsed if elapsed else 0.0  # noqa: E731
        return {"episodes": self._episodes, "episodes_per_second": rate(self._episodes),
                "generated_tokens": engine["generated_tokens"],
                "tokens_per_second": rate(engine["generated_tokens"]),
                "slot_occupancy": engine["slot_occupancy"], "queue_depth": self.queue.qsize(),
                "in_flight": self._in_flight, "policy_version": self.engine.policy_version,
                "publishes": self._publishes, "seconds": elapsed, "running": self.running,
                "env_failures": self.runner.env_failures, "env_failure_stages": dict(self.runner.env_failure_stages),
                "error": None if self.error is None else repr(self.error)}

    @property
    def failures(self) -> list[EpisodeFailure]:
        """The latest environment failures (oldest first): failed opens and grades (nothing was queued for
        them) and tool failures (their trajectories were queued with `env_failure` set)."""
        return list(self.runner.failures)

    # -- the thread --

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # noqa: BLE001 (surfaced through get / join / stop / stats)
            self.error = error
        finally:
            self._ended_at = time.perf_counter()

    async def _main(self) -> None:
        active: set[asyncio.Task] = set()
        exhausted = False
        driver = asyncio.ensure_future(self.runner.drive(lambda: self._stop.is_set() or (exhausted and not active)))
        try:
            while not self._stop.is_set():
                while not exhausted and len(active) < self.num_slots:
                    numbered = next(self._tasks, None)
                    if numbered is None:
                        exhausted = True
                        break
                    episode_id, task = numbered
                    active.add(asyncio.ensure_future(self._episode(task, episode_id)))
                self._in_flight = len(active)
                if exhausted and not active:
                    break
                done, _ = await asyncio.wait(active | {driver}, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                for finished in done:
                    if finished is driver:
                        driver.result()  # raises the driver's failure
                        if not self._stop.is_set() and active:
                            raise RuntimeError("the engine driver ended while episodes were in flight")
                        continue
                    active.discard(finished)
                    finished.result()  # an episode failure is a bug: surface it
            self._in_flight = len(active)
        finally:
            for task in (driver, *active):
                task.cancel()
            await asyncio.gather(driver, *active, return_exceptions=True)
            self._in_flight = 0

    async def _episode(self, task: Mapping, episode_id: int) -> None:
        try:
            trajectory = await self.runner.run_episode(task, episode_id)
        except EnvironmentFailure as failed:  # recorded by the runner (failures, stats); the worker goes on
            if not self.queue_failures:
                return
            trajectory = failed.trajectory  # its placeholder: the batch assembly accounts for every episode
        while True:  # bounded queue: wait for room without blocking the event loop
            try:
                self.queue.put_nowait(trajectory)
                break
            except queue.Full:
                if self._stop.is_set():
                    return
                await asyncio.sleep(0.01)
        self._episodes += 1

    def _apply_published(self) -> None:
        """Called by the driver between decode chunks: swap in the latest published weights."""
        with self._lock:
            published, self._published = self._published, None
        if published is not None:
            state, version = published
            if self._placement is None:
                self.engine.install_weights(state, version)  # each replica swaps between its requests
            else:
                nnx.update(self.model, state)  # the worker's own copy, already placed by `publish`
                self.engine.update_weights(self.model, version)
            self._publishes += 1
