"""Weights published while replicas sample: no request mixes two versions (`weights_swap="request"`), and an
async worker over 2 replicas queues every one of 500 episodes exactly once across a publish every few decode
chunks; the config checks of `rollout.replica`."""
from __future__ import annotations

import jax
import ml_collections
import pytest
from flax import nnx
from test_rollout_episode import ENTERPRISE, REAL_BUDGETS, REAL_SAMPLING, chatty_model, tokenizer  # noqa: F401
from test_rollout_worker import drain

from mercury_jax.config.validate import ConfigError, validate_config
from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.rollout import Engine, EngineSettings, EpisodeSettings, Request, replica_meshes
from mercury_jax.rollout.worker import RolloutWorker
from mercury_jax.train.rollouts import Rollouts
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C

EPISODES = 500


def replica_engine(group) -> EngineSettings:
    """4 slots over 2-chip bf16 replicas of the rollout group `group`."""
    devices = list(group.devices.flat)
    return EngineSettings(num_slots=4, devices=devices, replicas=replica_meshes(devices, {"tensor": 2}),
                          param_dtype="bfloat16")


@pytest.fixture(scope="module")
def model(tokenizer):  # noqa: F811
    return chatty_model(tokenizer)


def on_learner_mesh(model, devices):
    """A copy of `model` laid out like a learner's (fsdp over `devices`)."""
    return shard_params(nnx.clone(model), make_mesh({"fsdp": -1}, devices=devices))


@pytest.mark.slow  # ~25 s of CPU (its replicas' programs compile)
def test_request_swap_keeps_each_request_on_one_version():
    """Two running requests keep version 0 to their last token after a publish; a request submitted after the
    publish waits for them (no admission while weights wait) and runs wholly on version 5."""
    tiny = Qwen35MoeForCausalLM(C.tiny(vocab_size=80, num_hidden_layers=4), rngs=nnx.Rngs(3))
    newer = Qwen35MoeForCausalLM(C.tiny(vocab_size=80, num_hidden_layers=4), rngs=nnx.Rngs(4))
    engine = Engine(tiny, num_slots=4, max_length=48, steps_per_sync=4, weights_swap="request")
    engine.submit(Request(0, [1, 2, 3], max_new_tokens=20, temperature=0.0))
    engine.submit(Request(1, [4, 5], max_new_tokens=13, temperature=0.0))
    engine.step()
    engine.update_weights(newer, version=5)
    assert engine.weights_waiting and engine.policy_version == 0
    engine.submit(Request(2, [6, 7, 8], max_new_tokens=6, temperature=0.0))
    engine.step()
    assert engine.slots[2] is None and len(engine.queue) == 1  # free slots, but no admission while weights wait
    results = engine.run()
    assert results[0].policy_versions == [0] * 20 and results[1].policy_versions == [0] * 13
    assert results[2].policy_versions == [5] * 6 and not engine.weights_waiting
    fresh = Engine(newer, num_slots=4, max_length=48)
    fresh.submit(Request(2, [6, 7, 8], max_new_tokens=6, temperature=0.0))
    assert fresh.run()[2].tokens == results[2].tokens  # really sampled with the new weights
    idle = Engine(tiny, num_slots=2, max_length=48, weights_swap="request")
    idle.update_weights(newer, version=9)  # nothing running: swapped at once
    assert idle.policy_version == 9 and not idle.weights_waiting


@pytest.mark.slow
def test_worker_over_replicas_queues_every_episode_once_across_publishes(model, tokenizer):  # noqa: F811
    tasks = [{**ENTERPRISE[k % len(ENTERPRISE)], "task_id": f"e{k}"} for k in range(EPISODES)]
    meshes = replica_meshes(jax.devices()[:4], {"tensor": 2})
    learner = on_learner_mesh(model, jax.devices()[4:8])  # published from its own mesh: the collective route
    worker = RolloutWorker(model, tokenizer, iter(tasks), EpisodeSettings(budgets=REAL_BUDGETS, sampling=REAL_SAMPLING),
                           EngineSettings(num_slots=8, steps_per_sync=4, replicas=meshes, param_dtype="bfloat16"),
                           queue_size=16)
    assert worker.engine.num_replicas == 2 and worker.engine.num_slots == 8
    published, step = [], worker.engine.step

    def step_and_publish():  # from inside the worker's driver: a publish every 5th engine step
        more = step()
        if len(published) < 40 and worker.engine.engines[0]._decode_steps // 20 > len(published):
            published.append(len(published) + 1)
            worker.publish(nnx.state(learner), version=published[-1])
        return more

    worker.engine.step = step_and_publish
    worker.start()
    received = drain(worker, timeout=300)
    worker.join()
    ids = [t.task_id for t in received]
    assert len(ids) == EPISODES and sorted(ids) == sorted(t["task_id"] for t in tasks)  # in == out, no duplicates
    assert worker.stats()["publishes"] >= 5, worker.stats()
    versions_seen, mixed_turns = set(), 0
    for trajectory in received:
        turn = []  # the versions of one assistant turn (one request) in a row of sampled tokens
        for version, sampled in zip(trajectory.policy_versions + [-1], trajectory.action_mask + [0]):
            if sampled:
                turn.append(version)
                continue
            if turn:
                mixed_turns += len(set(turn)) > 1
                versions_seen.update(turn)
                turn = []
    assert mixed_turns == 0
    assert len(versions_seen) >= 3, versions_seen  # the publishes were really sampled with
    weights = worker.engine.engines[1].sampler._weights[0]
    assert {leaf.dtype.name for leaf in jax.tree.leaves(weights)} == {"bfloat16"}
    assert {d for leaf in jax.tree.leaves(weights) for d in leaf.sharding.device_set} == set(meshes[1].devices.flat)
    assert worker.engine.publisher._programs  # every publish went by publish.Publisher's collectives


def test_rollout_replica_config_must_split_the_group_and_the_slots():
    from experiments.sao import get_config

    config = get_config("tiny")
    config.devices = ml_collections.ConfigDict(dict(rollout=4, actor=2, critic=2))
    config.sao.batch_prompts = 4
    config.rollout.replica = ml_collections.ConfigDict(dict(tensor=3))
    with pytest.raises(ConfigError, match=r"rollout.replica \{'tensor': 3\} \(3 devices\) does not divide the "
                                          r"rollout group of 4"):
        validate_config(config)
    config.rollout.replica = ml_collections.ConfigDict(dict(tensor=1))
    config.rollout.num_slots = 6
    with pytest.raises(ConfigError, match=r"rollout.num_slots 6 does not split over 4 replicas"):
        validate_config(config)
    config.rollout.num_slots = 8
    validate_config(config)


@pytest.mark.slow  # ~30 s of CPU
def test_sync_rollouts_sample_over_replicas_and_publish_into_each(model, tokenizer):  # noqa: F811
    """The trainers' `Rollouts` with `replica=`: a batch sampled over 2 replicas of the 4-device rollout group, a
    publish cast to bf16 and placed into both replicas (idle: swapped at once), the next batch on the new version."""

    group = make_mesh({"fsdp": 4}, devices=jax.devices()[4:8])
    rollouts = Rollouts(model, tokenizer, EpisodeSettings(budgets=REAL_BUDGETS, sampling=REAL_SAMPLING),
                        replica_engine(group))
    assert rollouts.engine.num_replicas == 2 and rollouts.engine.slots_per_replica == 2
    first = rollouts.run(ENTERPRISE[:4], first_episode_id=0)
    assert len(first) == 4 and all(v in (-1, 0) for t in first for v in t.policy_versions)
    rollouts.publish(on_learner_mesh(model, jax.devices()[:2]), version=1)  # an actor mesh apart from the group
    assert rollouts.engine.publisher._programs  # by publish.Publisher's collectives
    assert [e.policy_version for e in rollouts.engine.engines] == [1, 1]
    second = rollouts.run(ENTERPRISE[:4], first_episode_id=4)
    assert {v for t in second for v, m in zip(t.policy_versions, t.action_mask) if m} == {1}
    devices = {d for e in rollouts.engine.engines for leaf in jax.tree.leaves(e.sampler._weights[0])
               for d in leaf.sharding.device_set}
    assert devices == set(jax.devices()[4:8])


@pytest.mark.slow  # ~40 s of CPU once the module's other replica tests are slow
def test_async_rollouts_hold_one_engine_between_evaluations(model, tokenizer):  # noqa: F811
    """Async mode: once the worker samples, the shared (evaluation) engine's weights and decode state are freed;
    `sync_engine` loads the latest weights for an evaluation, which samples wholly on them, and `evaluated` frees
    them again. An offloaded engine refuses to sample until it has weights, and a busy one refuses to offload."""
    from mercury_jax.data.task_order import TaskOrder

    group = make_mesh({"fsdp": 4}, devices=jax.devices()[4:8])
    rollouts = Rollouts(model, tokenizer, EpisodeSettings(budgets=REAL_BUDGETS, sampling=REAL_SAMPLING),
                        replica_engine(group), mode="async", queue_size=4)
    shared = rollouts.engine
    try:
        kept, _, _ = rollouts.collect(TaskOrder(ENTERPRISE, seed=0), 2)
        assert len(kept) == 2
        assert all(e.sampler._weights[0] is None and e.state is None for e in shared.engines)  # freed
        assert shared.policy_version == -1
        rollouts.publish(on_learner_mesh(model, jax.devices()[:2]), version=3)
        rollouts.sync_engine()
        assert [e.policy_version for e in shared.engines] == [3, 3]
        evaluated = rollouts.evaluator(seed=7).run(ENTERPRISE[:2], first_episode_id=0)
        assert {v for t in evaluated for v, m in zip(t.policy_versions, t.action_mask) if m} == {3}
        rollouts.evaluated()
        assert all(e.sampler._weights[0] is None and e.state is None for e in shared.engines)
    finally:
        rollouts.stop()
    engine = shared.engines[0]
    engine.submit(Request(request_id=0, prompt=[5, 9, 3], max_new_tokens=2, temperature=0.0))
    with pytest.raises(RuntimeError, match="engine was offloaded"):
        engine.step()
    with pytest.raises(RuntimeError, match="offload\\(\\) needs an idle engine: 1 queued"):
        engine.offload()
