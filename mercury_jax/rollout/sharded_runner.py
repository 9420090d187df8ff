"""Episodes of a multi-process run: each process runs those its own rollout replicas own, every process gets all.

    runner = ShardedRunner(EpisodeRunner(engine, ...), owners=[process of replica r for r in range(R)])
    trajectories = runner.run(tasks, first_episode_id=e)      # collective: every process calls it with the same tasks

Episode i (id e + i) belongs to the process of replica i mod R, so the episodes spread over the hosts as the replicas
do. A process runs its episodes on its own replicas (their engine: continuous batching as in one process), then one
host-level all-gather (`parallel.distributed.all_gather_objects`) hands every process every trajectory, in task
order. A request's tokens depend only on (seed, request id, weights) (`rollout/sampling.py`), and the ids are the
episodes' own, so the trajectories equal those of a single process running every episode (docs/DESIGN.md
"Multi-host").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax

from mercury_jax.parallel.distributed import all_gather_objects
from mercury_jax.rollout.trajectory import Trajectory


class ShardedRunner:
    """An `EpisodeRunner` whose `run` shares the episodes among the processes by replica ownership."""

    def __init__(self, runner, owners: Sequence[int]):
        if not owners:
            raise ValueError("ShardedRunner needs the owning process of at least one replica")
        self.runner, self.owners = runner, list(owners)

    def __getattr__(self, name):  # failures, stats, ... of the local runner
        return getattr(self.runner, name)

    def run(self, tasks: Sequence[Mapping], *, first_episode_id: int = 0) -> list[Trajectory]:
        me = jax.process_index()  # reads only its own tasks: a lazy window (data/task_order.py) stays unread
        mine = [i for i in range(len(tasks)) if self.owners[i % len(self.owners)] == me]
        local = self.runner.run([tasks[i] for i in mine], episode_ids=[first_episode_id + i for i in mine]) \
            if mine else []
        out: list[Trajectory | None] = [None] * len(tasks)
        for part in all_gather_objects(list(zip(mine, local))):
            for index, trajectory in part:
                out[index] = trajectory
        missing = [i for i, t in enumerate(out) if t is None]
        if missing:
            raise RuntimeError(f"episodes {missing[:5]} came back from no process; every process must call run "
                               "with the same tasks")
        return out
