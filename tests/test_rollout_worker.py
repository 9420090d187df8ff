"""RolloutWorker on a real tiny model (the chat-token-restricted model of test_rollout_episode): every trajectory
reaches the queue exactly once through a small bounded queue, on a sub-mesh of the fake CPU devices; a publish
mid-run changes the version of later tokens only; failures surface through get / join / stats."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from test_rollout_episode import BROWSE, ENTERPRISE, REAL_BUDGETS, REAL_SAMPLING, chatty_model, tokenizer  # noqa: F401

from mercury_jax.envs import make_episode
from mercury_jax.rollout.settings import EngineSettings, EpisodeSettings
from mercury_jax.rollout.worker import RolloutWorker

TASKS = ENTERPRISE[:4] + BROWSE[:1]
DEVICES = jax.devices()[4:6]  # every worker here on the same sub-mesh: one set of compilations


@pytest.fixture(scope="module")
def model(tokenizer):  # noqa: F811
    return chatty_model(tokenizer)


def drain(worker, timeout: float) -> list:
    """Every trajectory `worker` queues until it ends and its queue is empty (each `get` waits up to `timeout`)."""
    received = []
    while True:
        try:
            received.append(worker.get(timeout=timeout))
        except RuntimeError:  # ended, queue drained
            return received


def make_worker(model, tokenizer, tasks, *, environment=make_episode, **options):  # noqa: F811
    settings = EpisodeSettings(budgets=REAL_BUDGETS, sampling=REAL_SAMPLING, environment=environment)
    return RolloutWorker(model, tokenizer, tasks, settings, EngineSettings(num_slots=2, steps_per_sync=4,
                                                                           devices=DEVICES), **options)


def test_every_trajectory_reaches_the_queue_exactly_once(model, tokenizer):  # noqa: F811
    worker = make_worker(model, tokenizer, iter(TASKS), queue_size=1).start()
    received = drain(worker, timeout=120)
    worker.join()
    assert sorted(t.task_id for t in received) == sorted(t["task_id"] for t in TASKS)
    stats = worker.stats()
    assert stats["episodes"] == len(TASKS) and stats["queue_depth"] == 0 and stats["in_flight"] == 0
    assert stats["tokens_per_second"] > 0 and 0 < stats["slot_occupancy"] <= 1 and stats["error"] is None
    assert stats["generated_tokens"] == sum(t.num_action_tokens for t in received)
    assert not worker.engine.results and not worker.engine.parked
    params = jax.tree.leaves(nnx.state(worker.model, nnx.Param))
    assert all(set(p.sharding.device_set) == set(DEVICES) for p in params)  # the worker's own sub-mesh


def test_publish_mid_run_versions_later_tokens_only(model, tokenizer):  # noqa: F811
    worker = make_worker(model, tokenizer, iter(TASKS[:3]))
    new_weights = nnx.clone(model)
    new_weights.lm_head[...] = new_weights.lm_head[...] * 1.01
    step, steps = worker.engine.step, []

    def step_then_publish():  # publish from inside the 2nd decode chunk: applied before the 3rd
        more = step()
        steps.append(1)
        if len(steps) == 2:
            worker.publish(nnx.state(new_weights, nnx.Param), version=1)
        return more

    worker.engine.step = step_then_publish
    worker.start()
    trajectories = [worker.get(timeout=120) for _ in range(3)]
    worker.join()
    assert worker.stats()["publishes"] == 1 and worker.engine.policy_version == 1
    # published from device 0, swapped in on the worker's sub-mesh
    assert np.array_equal(np.asarray(worker.model.lm_head[...]), np.asarray(new_weights.lm_head[...]))
    assert set(worker.model.lm_head[...].sharding.device_set) == set(DEVICES)
    mixed = 0
    for traj in trajectories:
        sampled = [v for v, m in zip(traj.policy_versions, traj.action_mask) if m]
        assert set(sampled) <= {0, 1} and sampled == sorted(sampled)  # old tokens keep 0, later ones 1
        assert all(v == -1 for v, m in zip(traj.policy_versions, traj.action_mask) if not m)
        assert traj.policy_version == sampled[0]  # recorded per trajectory: the oldest version that sampled it
        mixed += len(set(sampled)) == 2
    assert mixed >= 1, "no episode was in flight across the publish"
    assert trajectories[-1].policy_versions[-1] == 1 or trajectories[-1].action_mask[-1] == 0


def test_failures_surface_instead_of_killing_the_thread_silently(model, tokenizer):  # noqa: F811
    worker = make_worker(model, tokenizer, iter([{**ENTERPRISE[0], "world": "atlantis"}])).start()
    with pytest.raises(RuntimeError, match="atlantis"):
        worker.get(timeout=60)
    with pytest.raises(RuntimeError, match="atlantis"):
        worker.join(timeout=10)
    assert "atlantis" in worker.stats()["error"]

    def broken_tasks():
        yield ENTERPRISE[0]
        raise OSError("task source went away")

    worker = make_worker(model, tokenizer, broken_tasks()).start()
    with pytest.raises(RuntimeError, match="task source went away"):
        worker.join(timeout=60)


def test_stop_abandons_in_flight_episodes_without_duplicates(model, tokenizer):  # noqa: F811
    def endless():
        k = 0
        while True:
            yield {**TASKS[k % len(TASKS)], "task_id": f"t{k}"}
            k += 1

    worker = make_worker(model, tokenizer, endless()).start()
    first = [worker.get(timeout=120) for _ in range(2)]
    worker.stop()
    rest = []
    while not worker.queue.empty():
        rest.append(worker.queue.get_nowait())
    ids = [t.task_id for t in first + rest]
    assert len(ids) == len(set(ids)) and not worker.running
    assert all(t.tokens for t in first)


def test_failing_environments_cost_their_episodes_and_the_worker_goes_on(model, tokenizer):  # noqa: F811
    """12 tasks; one environment fails to open, one's grade raises: 10 trajectories reach the queue, the two
    failures are recorded and counted in stats, and the worker ends normally (it did not die at the first)."""
    from test_rollout_episode import failing_factory, twelve_tasks

    tasks = twelve_tasks()
    worker = make_worker(model, tokenizer, iter(tasks),
                         environment=failing_factory({"open": "t03", "grade": "t08"})).start()
    received = drain(worker, timeout=120)
    worker.join()
    assert sorted(t.task_id for t in received) == [t["task_id"] for t in tasks if t["task_id"] not in ("t03", "t08")]
    assert all(t.env_failure is None for t in received)
    assert [(f.task_id, f.stage) for f in sorted(worker.failures, key=lambda f: f.task_id)] == [("t03", "open"),
                                                                                               ("t08", "grade")]
    stats = worker.stats()
    assert stats["env_failures"] == 2 and stats["env_failure_stages"] == {"open": 1, "grade": 1}
    assert stats["episodes"] == 10 and stats["error"] is None and not worker.running
    assert not worker.engine.results and not worker.engine.parked  # the failed episodes released their slots
