"""The async batch assembly (mercury_jax/train/async_batches.py) in one process, with a stand-in worker: the choice in
episode order, stale and environment-failed trajectories dropped and counted, leftovers kept for the next step, the
accounting (handed out = trained + dropped + unsettled), and a resume that re-samples exactly the unsettled episodes
before going on. The same code runs on several processes in tests/test_multihost_train.py."""
from __future__ import annotations

import queue

import pytest

from mercury_jax.data.task_order import TaskOrder
from mercury_jax.rollout.trajectory import Trajectory
from mercury_jax.train.async_batches import AsyncBatches, AsyncLayoutChanged

TASKS = [{"task_id": f"t{i}"} for i in range(5)]
TIMEOUT_S = 5.0  # every collect here has its batch at once: a collect still waiting after this is a bug, not a hang


class StandInWorker:
    """What AsyncBatches reads of a RolloutWorker: its queue, whether it runs, its error."""

    def __init__(self):
        self.queue, self.running, self.error = queue.Queue(), False, None

    def start(self):
        self.running = True

    def raise_if_failed(self):
        pass


class LastTrajectoriesWorker(StandInWorker):
    """A worker that has sampled its last trajectories: it runs while its queue still holds some."""

    running = property(lambda self: not self.queue.empty(), lambda self, value: None)


def finished(episode: int, version: int, env_failure: str | None = None) -> Trajectory:
    return Trajectory(task_id=f"e{episode}", tokens=[7], action_mask=[1], rollout_logprobs=[-1.0],
                      policy_versions=[version], prompt_length=0, env_failure=env_failure, episode_id=episode)


def started(batches: AsyncBatches, count: int, tasks=None) -> list[int]:
    """The worker's side: take `count` (episode id, task) pairs from the share."""
    tasks = tasks or batches.tasks()
    return [next(tasks)[0] for _ in range(count)]


def test_a_batch_is_chosen_in_episode_order_and_everything_handed_out_is_accounted():
    """A round takes at most n finished trajectories a host (in the order they finished) and chooses among what has
    arrived in episode order; what is left waits in the worker's queue or the pool. Planted bug: `> self.max_staleness`
    -> `>= self.max_staleness` in AsyncBatches.collect (a TimeoutError after TIMEOUT_S, not a wait of 3600 s)."""
    stream = TaskOrder(TASKS, seed=0)
    batches = AsyncBatches(stream, owners=[0, 0], max_staleness=1, poll_s=0.0, timeout_s=TIMEOUT_S)
    worker = StandInWorker()
    batches.start(worker)
    assert started(batches, 6) == [0, 1, 2, 3, 4, 5]
    for episode in (3, 1, 0):
        worker.queue.put(finished(episode, version=0))
    kept, stale, env_failed = batches.collect(2, version=0)
    assert [t.episode_id for t in kept] == [1, 3] and (stale, env_failed) == (0, 0)
    assert batches.handed_out == 6 and batches.unsettled == {0, 2, 4, 5} and worker.queue.qsize() == 1
    # at version 2, episode 0 (sampled by version 0) is 2 versions behind: more than max_staleness = 1
    worker.queue.put(finished(2, 1, env_failure="grade: the judge gave no verdict"))
    for episode in (4, 5):
        worker.queue.put(finished(episode, 1))
    kept, stale, env_failed = batches.collect(2, version=2)
    assert [t.episode_id for t in kept] == [4, 5] and (stale, env_failed) == (1, 1)
    assert batches.unsettled == set() and batches.pool == {}
    assert batches.handed_out == 4 + 1 + 1  # trained + stale + environment failure
    assert [stream.at(e)["task_id"] for e in range(6)] == [t["task_id"] for t in TaskOrder(TASKS, 0).take(6)]


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_a_trajectory_exactly_max_staleness_behind_is_kept_and_one_more_is_dropped(max_staleness):
    """The worker ends once its two trajectories are drained, so a collect that keeps neither fails at once instead
    of waiting. Planted bug: `version - trajectory.policy_version > self.max_staleness` -> `>=` in
    AsyncBatches.collect."""
    version = 5
    batches = AsyncBatches(TaskOrder(TASKS, seed=0), owners=[0], max_staleness=max_staleness, poll_s=0.0,
                           timeout_s=TIMEOUT_S)
    worker = LastTrajectoriesWorker()
    batches.start(worker)
    started(batches, 2)
    worker.queue.put(finished(0, version=version - max_staleness - 1))  # one version too old
    worker.queue.put(finished(1, version=version - max_staleness))      # as old as allowed
    kept, stale, env_failed = batches.collect(1, version=version)
    assert [t.episode_id for t in kept] == [1] and (stale, env_failed) == (1, 0)


def test_a_resume_samples_the_unsettled_episodes_first_then_goes_on():
    stream = TaskOrder(TASKS, seed=3)
    batches = AsyncBatches(stream, owners=[0], max_staleness=1, poll_s=0.0, timeout_s=TIMEOUT_S)
    worker = StandInWorker()
    batches.start(worker)
    started(batches, 5)
    for episode in (0, 2):
        worker.queue.put(finished(episode, 0))
    batches.collect(2, version=0)
    meta = batches.meta()
    assert meta["async_rollouts"]["unsettled"] == [1, 3, 4] and meta["async_rollouts"]["handed_out"] == 5

    resumed = AsyncBatches(stream, owners=[0], max_staleness=1, poll_s=0.0, timeout_s=TIMEOUT_S)
    resumed.restore(meta)
    tasks = resumed.tasks()
    pairs = [next(tasks) for _ in range(5)]
    assert [e for e, _ in pairs] == [1, 3, 4, 5, 6]  # the unsettled ones (same ids), then the share from 5 on
    assert [task["task_id"] for _, task in pairs] == [stream.at(e)["task_id"] for e in (1, 3, 4, 5, 6)]
    resumed.start(StandInWorker())
    resumed.collect(0, version=1)  # a round: the positions the worker reached are now handed out
    assert resumed.handed_out == 7 and resumed.unsettled == {1, 3, 4, 5, 6}


def test_a_resume_on_another_layout_is_refused_by_name():
    batches = AsyncBatches(TaskOrder(TASKS, seed=0), owners=[0, 0], max_staleness=1)
    other = AsyncBatches(TaskOrder(TASKS, seed=0), owners=[0], max_staleness=1)
    with pytest.raises(AsyncLayoutChanged, match="resumes only on the same layout"):
        other.restore(batches.meta())


def test_no_batch_when_every_worker_has_ended():
    batches = AsyncBatches(TaskOrder(TASKS, seed=0), owners=[0], max_staleness=1, poll_s=0.0, timeout_s=TIMEOUT_S)
    batches.start(None)
    with pytest.raises(RuntimeError, match="every rollout worker has ended with 0 of 2"):
        batches.collect(2, version=0)


def test_a_failed_worker_ends_the_collect_with_its_error():
    batches = AsyncBatches(TaskOrder(TASKS, seed=0), owners=[0], max_staleness=1, poll_s=0.0, timeout_s=TIMEOUT_S)
    worker = StandInWorker()
    batches.start(worker)
    worker.error = ConnectionError("the MCP host went away")

    def raise_if_failed():
        raise RuntimeError(f"rollout worker failed: {worker.error!r}")
    worker.raise_if_failed = raise_if_failed
    with pytest.raises(RuntimeError, match="rollout worker failed: ConnectionError"):
        batches.collect(2, version=0)
