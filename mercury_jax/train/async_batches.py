"""Async rollouts on one process or many: every rollout host samples its own share of the task stream without end,
and every process agrees on each learner step's batch (docs/DESIGN.md "Multi-host", "Async across hosts").

    batches = AsyncBatches(stream, owners, max_staleness=1)
    batches.start(worker)                        # this process's RolloutWorker (its own replicas), or None
    kept, stale, env_failed = batches.collect(n, version)   # every process, every step, together

Shares: stream position i is episode i, owned by the process of replica i mod R (as in sync mode,
`rollout/sharded_runner.py`); a process's worker takes its positions in order, from `AsyncBatches.tasks()`, and
queues each finished trajectory (environment failures as placeholders) at once. No rollout host waits for another.

A batch, in rounds: each process drains up to n finished trajectories from its worker's queue and hands them, with
how far its worker has read its share, to every process by one host all-gather (`distributed.all_gather_objects`).
Every process then holds the same pool and makes the same choice: in episode order, an environment failure is
dropped (counted), a trajectory more than `max_staleness` versions behind `version` is dropped (counted), and the
others fill the batch. Too few: another round after `poll_s`. What is not taken stays in the pool for the next step.
The bounded worker queues hold the run-ahead: a host whose queue is full stops sampling until the learner drains it.

Every episode handed out is trained on once or counted as dropped: the pool and the unsettled set are the same on
every process, `meta()` snapshots them after the batch is chosen (next share positions, the episode ids handed out
and not yet settled, the count handed out), and a resumed run (`restore`) first re-samples the unsettled episodes
of each share (same ids, so the same request seeds), then goes on from the saved positions. Episodes handed out
after the snapshot are handed out again. Resuming needs the same process count and replica layout (named error).
"""
from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator, Sequence

import jax

from mercury_jax.data.task_order import TaskOrder
from mercury_jax.parallel.distributed import all_gather_objects
from mercury_jax.rollout.trajectory import Trajectory


class AsyncLayoutChanged(ValueError):
    """An async run resumed on another process count or replica layout than its checkpoint's."""


class AsyncBatches:
    def __init__(self, stream: TaskOrder, owners: Sequence[int], *, max_staleness: int, poll_s: float = 0.05,
                 timeout_s: float = 3600.0):
        self.stream, self.owners = stream, list(owners) or [0]  # no replicas (one process): one share, process 0
        self.max_staleness, self.poll_s, self.timeout_s = max_staleness, poll_s, timeout_s
        self.processes = jax.process_count()
        self.residues = {p: [r for r, owner in enumerate(self.owners) if owner == p] for p in range(self.processes)}
        self.next = {p: 0 for p in range(self.processes)}  # share positions handed out, every process's (global)
        self.unsettled: set[int] = set()   # episodes handed out, not yet trained or dropped (global)
        self.pool: dict[int, Trajectory] = {}  # finished, not yet settled (global)
        self.handed_out = 0
        self.rerun: list[int] = []         # this process's unsettled episodes of a resumed run, sampled first
        self.local_next = 0                # how far this process's worker has read its share
        self.worker = None
        self.snapshot = self._state()

    # -- the task side --
    def tasks(self) -> Iterator[tuple[int, dict]]:
        """This process's share, as (episode id, task): a resumed run's unsettled episodes first, then the share
        from its saved position on. Read by the worker's thread; `local_next` counts what it has taken."""
        for episode in self.rerun:
            yield episode, self.stream.at(episode)
        if not self.residues[jax.process_index()]:
            return
        for position in itertools.count(self.local_next):
            episode = self.episode_of(jax.process_index(), position)
            self.local_next = position + 1  # handed out from here on (before the worker sees it)
            yield episode, self.stream.at(episode)

    def episode_of(self, process: int, position: int) -> int:
        mine = self.residues[process]
        round_, index = divmod(position, len(mine))
        return round_ * len(self.owners) + mine[index]

    def start(self, worker) -> None:
        """Start this process's worker (None: a process without rollout replicas samples nothing)."""
        self.worker = worker
        if worker is not None and self.residues[jax.process_index()]:
            worker.start()

    # -- the learner side --
    def collect(self, n: int, version: int) -> tuple[list[Trajectory], int, int]:
        """(n trajectories to learn from, dropped as stale, dropped for an environment failure); every process calls
        it with the same n and version and gets the same answer."""
        kept: list[Trajectory] = []
        stale = env_failed = 0
        started = time.monotonic()
        while True:
            finished = self._drain(n)
            failure = None if self.worker is None or self.worker.error is None else repr(self.worker.error)
            local = (finished, self.local_next, self._worker_alive(), time.monotonic() - started > self.timeout_s,
                     failure)
            gathered = all_gather_objects(local)
            self._raise_if_a_worker_failed([g[4] for g in gathered])
            for process, (trajectories, position, *_) in enumerate(gathered):
                self._handed(process, position)
                for trajectory in trajectories:
                    self.pool[trajectory.episode_id] = trajectory
            for episode in sorted(self.pool):
                trajectory = self.pool[episode]
                if trajectory.env_failure is not None:
                    env_failed += 1
                elif version - trajectory.policy_version > self.max_staleness:
                    stale += 1
                elif len(kept) < n:
                    kept.append(trajectory)
                else:
                    continue
                del self.pool[episode]
                self.unsettled.discard(episode)
            if len(kept) == n:
                break
            if not any(alive for _, _, alive, _, _ in gathered):
                self._raise_worker_error()
                raise RuntimeError(f"every rollout worker has ended with {len(kept)} of {n} trajectories for this "
                                   f"batch (tasks exhausted or stopped)")
            if any(late for _, _, _, late, _ in gathered):
                raise TimeoutError(f"no batch of {n} trajectories within {self.timeout_s:.0f} s ({len(kept)} so far)")
            time.sleep(self.poll_s)
        self.snapshot = self._state()
        return kept, stale, env_failed

    # -- checkpointed state --
    def meta(self) -> dict:
        """The snapshot taken when the last batch was chosen (what the checkpoint after that step holds)."""
        return {"async_rollouts": self.snapshot}

    def restore(self, meta: dict) -> None:
        state = meta.get("async_rollouts")
        if state is None:
            return  # a checkpoint from before this run used async rollouts: start the shares afresh
        if state["processes"] != self.processes or state["owners"] != self.owners:
            raise AsyncLayoutChanged(
                f"this async run was checkpointed on {state['processes']} processes with replica owners "
                f"{state['owners']}; it resumes only on the same layout (now {self.processes} processes, owners "
                f"{self.owners}): rerun with the same process count and devices")
        self.next = {int(p): n for p, n in state["next"].items()}
        self.unsettled, self.handed_out = set(state["unsettled"]), state["handed_out"]
        self.local_next = self.next[jax.process_index()]
        self.rerun = sorted(e for e in self.unsettled if self.owners[e % len(self.owners)] == jax.process_index())
        self.pool.clear()
        self.snapshot = self._state()

    # -- helpers --
    def _state(self) -> dict:
        return {"processes": self.processes, "owners": self.owners, "next": {str(p): n for p, n in self.next.items()},
                "unsettled": sorted(self.unsettled), "handed_out": self.handed_out}

    def _handed(self, process: int, position: int) -> None:
        for j in range(self.next[process], position):
            self.unsettled.add(self.episode_of(process, j))
            self.handed_out += 1
        self.next[process] = max(self.next[process], position)

    def _drain(self, limit: int) -> list[Trajectory]:
        out = []
        if self.worker is None:
            return out
        while len(out) < limit:
            try:
                out.append(self.worker.queue.get_nowait())
            except queue.Empty:
                break
        return out

    def _worker_alive(self) -> bool:
        return self.worker is not None and self.worker.running

    def _raise_worker_error(self) -> None:
        if self.worker is not None:
            self.worker.raise_if_failed()

    def _raise_if_a_worker_failed(self, failures: list[str | None]) -> None:
        """A rollout worker that died on any process ends the run on every process (else its share would go
        unsampled while the others carry on): its own process re-raises its error, the others name it."""
        if not any(failures):
            return
        self._raise_worker_error()
        process = next(p for p, failure in enumerate(failures) if failure)
        raise RuntimeError(f"the rollout worker of process {process} failed: {failures[process]}")
