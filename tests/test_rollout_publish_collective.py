"""The collective weight publish (`rollout/publish.py`) on the 8-device CPU mesh, against the plain route (cast, then
`jax.device_put` into each replica's layout): the same bf16 values bit for bit, the same layouts, on the replicas'
devices only; the send program is collective-permutes that give every replica device exactly one source with its
own in-replica coordinate; a replicated engine publishes through it (the plain route's weights, bit for bit).
"""
from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.rollout import EngineSettings, ReplicatedEngine, replica_meshes
from mercury_jax.rollout.layout import rollout_weights
from mercury_jax.rollout.publish import Publisher
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C

VOCAB = 80


def tiny_model(seed: int = 3):
    return Qwen35MoeForCausalLM(C.tiny(vocab_size=VOCAB, num_hidden_layers=4), rngs=nnx.Rngs(seed))


def on_source(model, devices, shape=None):
    """`model` laid out on a learner-like mesh (fsdp over `devices` unless `shape`)."""
    return shard_params(model, make_mesh(shape or {"fsdp": -1}, devices=devices))


# (source devices, source mesh, replica shape): C = source / replica size copies, R replicas on the other devices
LAYOUTS = {
    "fsdp4->2x(tensor2)": (4, None, {"tensor": 2}),                     # C = 2, R = 2: one round
    "fsdp2->3x(tensor2)": (2, None, {"tensor": 2}),                     # C = 1, R = 3: three rounds
    "fsdp2xtensor2->1x(data2,tensor2)": (4, {"fsdp": 2, "tensor": 2}, {"data": 2, "tensor": 2}),
}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name == "fsdp4->2x(tensor2)"
                                    else name for name in LAYOUTS])  # the first pays the compiles: ~13 s of CPU
def test_publish_equals_cast_and_device_put_per_replica(layout):
    n_source, source_shape, replica = LAYOUTS[layout]
    devices = jax.devices()
    _, params = nnx.split(on_source(tiny_model(), devices[-n_source:], source_shape))
    meshes = replica_meshes(devices[:-n_source], replica)
    publisher = Publisher(meshes, "bfloat16")
    assert publisher.supports(params)
    published = publisher(params)
    assert len(published) == len(meshes)
    for mesh, tree in zip(meshes, published):
        expected = rollout_weights(params, mesh, "bfloat16")
        assert jax.tree.structure(tree) == jax.tree.structure(expected)
        for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(expected)):
            assert got.dtype == want.dtype == np.dtype("bfloat16") and got.shape == want.shape
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
            assert got.sharding.device_set == set(mesh.devices.flat)  # only this replica's devices
            np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_send_program_gives_each_replica_device_one_source_of_its_own_coordinate():
    devices = jax.devices()
    _, params = nnx.split(on_source(tiny_model(), devices[6:]))  # C = 1 copy of a 2-device replica
    meshes = replica_meshes(devices[:6], {"tensor": 2})  # R = 3 -> 3 rounds
    publisher = Publisher(meshes, "bfloat16")
    _, send = publisher.lower(params)
    hlo = send.compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" not in hlo
    rounds = set(re.findall(r"collective-permute(?:-start)?\(.*?source_target_pairs=\{([^}]*\}(?:,\{[^}]*\})*)\}",
                            hlo))
    union = publisher._programs_for(params).union
    position = {d.id: i for i, d in enumerate(union.devices.flat)}  # union device order: source, then replicas
    targets = {}
    for pairs in rounds:
        for src, dst in re.findall(r"\{(\d+),(\d+)\}", pairs):
            targets.setdefault(int(dst), set()).add(int(src))
    replica_positions = range(2, 8)
    assert set(targets) == set(replica_positions), targets
    for dst, sources in targets.items():
        (src,) = sources
        assert src < 2 and src % 2 == dst % 2  # a source-copy device with the same in-replica coordinate
    assert max(position.values()) == 7


def test_publish_is_a_copy_of_its_own_and_compiles_once():
    devices = jax.devices()
    model = on_source(tiny_model(), devices[4:])
    meshes = replica_meshes(devices[:4], {"tensor": 2})
    publisher = Publisher(meshes, "bfloat16")
    first = publisher(nnx.state(model))
    newer = on_source(tiny_model(seed=11), devices[4:])
    state = nnx.state(newer)
    expected = [np.asarray(a.astype("float32")) for a in jax.tree.leaves(rollout_weights(state, meshes[1],
                                                                                          "bfloat16"))]
    second = publisher(state)
    for leaf in jax.tree.leaves(state):
        leaf.delete()  # the learner may drop or donate what it published
    for got, want in zip(jax.tree.leaves(second[1]), expected):
        np.testing.assert_array_equal(np.asarray(got.astype("float32")), want)
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(first[1]), jax.tree.leaves(second[1])))
    programs = publisher._programs_for(nnx.state(model))
    assert len(publisher._programs) == 1 and programs.send._cache_size() == 1 and programs.stage._cache_size() == 1


def test_publish_refuses_sources_it_cannot_send_from():
    devices = jax.devices()
    meshes = replica_meshes(devices[:4], {"tensor": 2})
    publisher = Publisher(meshes, "bfloat16")
    model = tiny_model()
    assert not publisher.supports(nnx.state(model))  # one uncommitted device: the plain route
    assert not publisher.supports(nnx.state(on_source(tiny_model(), devices[2:6])))  # overlaps replica 1
    assert not publisher.supports(nnx.state(on_source(tiny_model(), devices[5:8])))  # 3 devices, replica size 2
    with pytest.raises(ValueError, match="disjoint from the rollout replicas"):
        publisher(nnx.state(model))


@pytest.mark.slow  # ~14 s of CPU
def test_replicated_engine_publishes_by_collectives():
    """`ReplicatedEngine.update_weights` from a learner mesh takes the collective route and installs exactly the
    plain route's weights (sampling after such a publish: tests/test_rollout_replica_worker.py)."""
    devices = jax.devices()
    meshes = replica_meshes(devices[:4], {"tensor": 2})
    learner = on_source(tiny_model(), devices[4:])
    engine = ReplicatedEngine(learner, EngineSettings(num_slots=2 * len(meshes), max_length=32, replicas=meshes,
                                                      param_dtype="bfloat16"))
    newer = on_source(tiny_model(seed=11), devices[4:])
    engine.update_weights(newer, version=1)
    assert engine.publisher._programs  # the collective route was taken
    assert [replica.policy_version for replica in engine.engines] == [1, 1]  # idle replicas swap at once
    for replica, mesh in zip(engine.engines, meshes):
        expected = rollout_weights(nnx.state(newer), mesh, "bfloat16")
        for got, want in zip(jax.tree.leaves(replica.sampler._weights[0]), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
