"""RolloutWorker.publish takes its own copy of the weights before it returns: a learner step that donates the
published arrays right after the publish (the SAO loop's next actor step) cannot delete what the worker decodes
with, also when the worker and the learner share one device (where a plain `device_put` to the same sharding
would hand back the learner's own buffer)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_rollout_episode import ENTERPRISE, REAL_SAMPLING, chatty_model, tokenizer  # noqa: F401

from mercury_jax.rollout.settings import Budgets, EngineSettings, EpisodeSettings
from mercury_jax.rollout.worker import RolloutWorker
from mercury_jax.train.placement import device_copy
from mercury_jax.train.state import TrainState, make_update_step

BUDGETS = Budgets(max_tool_turns=1, max_total_tokens=640, max_turn_tokens=4)  # one short turn is enough
SHARED = [jax.devices()[0]]  # learner and worker on one device: the case where an alias is easiest to get


@pytest.fixture(scope="module")
def model(tokenizer):  # noqa: F811
    return chatty_model(tokenizer)


def _donating_step(state: TrainState):
    """One SGD step on a loss over every parameter that donates the old params (as the trainers' steps do)."""
    def loss_fn(m, batch):
        return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(nnx.state(m, nnx.Param))) * batch["scale"], {}
    return make_update_step(state.graphdef, state.tx, loss_fn, donate=True)


def test_publish_then_donating_update_then_decode(model, tokenizer):  # noqa: F811
    devices = SHARED  # (a worker on its own sub-mesh: the async SAO run in test_train_reliability.py)
    actor = TrainState.create(device_copy(model, jax.devices()[0]), optax.sgd(1e-3))
    # copies (np.array), not views: a NumPy view of a CPU buffer is an external reference, which blocks donation
    published = {jax.tree_util.keystr(p): np.array(v) for p, v in
                  jax.tree_util.tree_flatten_with_path(nnx.state(actor.model(), nnx.Param))[0]}
    worker = RolloutWorker(model, tokenizer, iter(ENTERPRISE[:1]), EpisodeSettings(budgets=BUDGETS,
                                                                                   sampling=REAL_SAMPLING),
                           EngineSettings(num_slots=1, devices=devices, steps_per_sync=4))
    live = jax.tree.leaves(actor.params)
    worker.publish(nnx.state(actor.model()), version=1)  # the actor's live arrays, as run_sao publishes them
    step = _donating_step(actor)
    actor.params, actor.opt_state, _ = step(actor.params, actor.frozen, actor.opt_state, {"scale": jnp.float32(1)})
    assert all(x.is_deleted() for x in live)  # the update really donated what was published

    worker.start()
    trajectory = worker.get(timeout=120)  # the decode swaps the published weights in first
    worker.join()
    assert worker.stats()["publishes"] == 1 and worker.engine.policy_version == 1
    assert set(trajectory.policy_versions) - {-1} == {1}
    got = {jax.tree_util.keystr(p): np.asarray(v) for p, v in
           jax.tree_util.tree_flatten_with_path(nnx.state(worker.model, nnx.Param))[0]}
    assert got.keys() == published.keys()
    for path, value in published.items():  # the weights as published, not the update's
        np.testing.assert_array_equal(got[path], value, err_msg=path)
    assert all(set(x.sharding.device_set) == set(devices) for x in jax.tree.leaves(nnx.state(worker.model)))


def test_publish_of_a_foreign_structure_names_the_paths(model, tokenizer):  # noqa: F811
    worker = RolloutWorker(model, tokenizer, iter([]), EpisodeSettings(budgets=BUDGETS, sampling=REAL_SAMPLING),
                           EngineSettings(num_slots=1))
    with pytest.raises(ValueError, match=r"published weights hold \['no_such_layer'\] \(1 in all\).*publish "
                                         r"nnx.state\(model\)"):
        worker.publish({"no_such_layer": jnp.zeros(3)}, version=1)


def test_device_copy_never_aliases_on_the_same_device(model):
    source = device_copy(model, jax.devices()[0])
    copy = device_copy(source, jax.devices()[0])
    for a, b in zip(jax.tree.leaves(nnx.state(source)), jax.tree.leaves(nnx.state(copy))):
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
