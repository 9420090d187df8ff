"""Role meshes and models born sharded (train/placement.py, config/roles.py, parallel/sharding.py): each learner role
gets its own (data, fsdp, expert, tensor) mesh over its device group, a config that cannot be laid out fails
validation naming the role, and the policy, the critic and the GRPO reference are created straight into their role's
sharding with the values of an unsharded build: copies and casts exactly; a preset's jitted sharded init to 2 fp32
ulp (the same random bits, scaled inside one fused program instead of op by op; observed 1 ulp on ~27% of the lm
head)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from experiments.grpo import get_config as grpo_config
from experiments.sao import get_config as sao_config
from mercury_jax.config.model import build_model
from mercury_jax.config.roles import ROW_AXES, role_mesh_sizes, row_shards
from mercury_jax.config.validate import ConfigError, validate_config
from mercury_jax.parallel import init_sharded, make_mesh, variable_sharding
from mercury_jax.train.grpo_learner import frozen_reference
from mercury_jax.train.placement import batch_to_mesh, role_meshes
from models.qwen35_moe.critic import Qwen35MoeCritic

VOCAB = 256
ULP2 = 2.4e-7  # two fp32 roundings: the jitted init fuses the scale of the normal draws differently from eager ops


def sao_on_8(**mesh) -> ml_collections.ConfigDict:
    config = sao_config("tiny")
    config.devices = ml_collections.ConfigDict(dict(rollout=2, actor=4, critic=2))
    for role, sizes in mesh.items():
        config.mesh[role].update(sizes)
    return config


def test_each_role_gets_its_group_and_its_axes():
    config = sao_on_8(actor=dict(fsdp=2, expert=2))
    meshes = role_meshes(config, ("rollout", "actor", "critic"))
    devices = jax.devices()
    assert list(meshes["rollout"].devices.flat) == devices[:2]
    assert list(meshes["actor"].devices.flat) == devices[2:6]
    assert list(meshes["critic"].devices.flat) == devices[6:8]
    assert dict(meshes["actor"].shape) == {"data": 1, "fsdp": 2, "sequence": 1, "expert": 2, "tensor": 1}
    # fsdp = -1: the rest
    assert dict(meshes["critic"].shape) == {"data": 1, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 1}
    assert row_shards(meshes["actor"].shape) == 4 and ROW_AXES == ("data", "fsdp", "expert")
    batch = batch_to_mesh({"tokens": np.arange(8 * 3).reshape(8, 3)}, meshes["actor"])
    assert {s.data.shape for s in batch["tokens"].addressable_shards} == {(2, 3)}  # rows split 4 ways


def test_grpo_reference_shares_the_actors_devices_on_its_own_mesh():
    config = grpo_config("tiny")
    config.devices = ml_collections.ConfigDict(dict(rollout=4, actor=4))
    config.mesh.reference.update(dict(fsdp=1, tensor=-1))
    meshes = role_meshes(config, ("actor", "reference"))
    assert list(meshes["reference"].devices.flat) == list(meshes["actor"].devices.flat) == jax.devices()[4:]
    assert dict(meshes["reference"].shape)["tensor"] == 4 and dict(meshes["actor"].shape)["fsdp"] == 4


def test_every_role_on_the_default_device_when_the_groups_are_zero():
    config = sao_config("tiny")  # devices all 0
    meshes = role_meshes(config, ("rollout", "actor", "critic"))
    assert all(list(m.devices.flat) == jax.devices()[:1] for m in meshes.values())


def test_a_mesh_that_does_not_fit_its_group_names_the_role_shape_and_count():
    config = sao_on_8(critic=dict(fsdp=4))
    with pytest.raises(ValueError, match=r"mesh.critic .*'fsdp': 4.* does not fit the critic role's 2 device"):
        role_mesh_sizes(config, "critic")
    with pytest.raises(ConfigError, match=r"mesh.critic .* does not fit the critic role's 2 device"):
        validate_config(config)
    config = sao_on_8(actor=dict(fsdp=-1, tensor=-1))
    with pytest.raises(ConfigError, match=r"at most one mesh axis may be -1"):
        validate_config(config)


def test_rows_must_split_over_the_row_axes_of_each_learner_mesh():
    config = sao_on_8(actor=dict(fsdp=1, data=2, expert=2))
    config.sao.batch_prompts = 6  # 6 rows over 4 row shards
    with pytest.raises(ConfigError, match=r"sao.batch_prompts 6 is not divisible by the 4 row shards of the actor"):
        validate_config(config)
    config = sao_on_8(actor=dict(fsdp=1, tensor=4))  # tensor repeats rows: 1 row shard, any batch splits
    config.sao.batch_prompts = 6
    config.sao.critic_micro_batches = 3
    validate_config(config)


def test_released_model_runtime_is_checked():
    config = sao_config("tiny")
    config.model.gdn_impl = "triton"
    with pytest.raises(ConfigError, match=r"model.gdn_impl is 'triton'; use one of \['auto', 'chunked'"):
        validate_config(config)
    config = sao_config("tiny")
    config.model.attention_impl = "splash"
    with pytest.raises(ConfigError, match=r"'splash' is the Pallas TPU kernel .*attention_impl=blockwise"):
        validate_config(config)


def _flat(module) -> dict:
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(nnx.state(module))}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 1, "fsdp": 2, "expert": 2, "tensor": 2})


@pytest.fixture(scope="module")
def eager_policy():
    return build_model(sao_config("tiny").model, VOCAB, seed=3)


@pytest.fixture(scope="module")
def sharded_policy(mesh):
    return build_model(sao_config("tiny").model, VOCAB, seed=3, mesh=mesh)


def test_a_preset_is_born_sharded_with_the_eager_values(mesh, eager_policy, sharded_policy):
    eager, sharded = _flat(eager_policy), _flat(sharded_policy)
    assert eager.keys() == sharded.keys()
    split = 0
    for path, variable in nnx.to_flat_state(nnx.state(sharded_policy)):
        array = variable.get_value()
        assert array.sharding == variable_sharding(path, variable, mesh), path
        np.testing.assert_allclose(np.asarray(array), np.asarray(eager[path]), rtol=ULP2, atol=0, err_msg=str(path))
        split += max(s.data.size for s in array.addressable_shards) < array.size
    assert split > len(eager) // 2  # most parameters are split (a few tiny ones have no divisible axis)


def test_the_critic_backbone_is_copied_straight_into_the_critic_mesh(mesh, sharded_policy):
    critic_mesh = make_mesh({"fsdp": 4, "tensor": 2}, devices=jax.devices()[::-1])  # other layout, other order
    critic = Qwen35MoeCritic.from_policy(sharded_policy, mesh=critic_mesh)
    policy = _flat(sharded_policy.model)
    for path, variable in nnx.to_flat_state(nnx.state(critic.model)):
        array = variable.get_value()
        assert array.sharding == variable_sharding(("model", *path), variable, critic_mesh), path
        np.testing.assert_array_equal(np.asarray(array), np.asarray(policy[path]))
    assert float(jnp.abs(critic.value_head[...]).sum()) == 0.0


def test_a_critic_on_the_policys_own_mesh_shares_no_buffer(mesh, sharded_policy):
    """The actor step donates its parameters: a critic aliasing them would be deleted with them."""
    critic = Qwen35MoeCritic.from_policy(sharded_policy, mesh=mesh)
    policy = _flat(sharded_policy.model)

    def pointers(array):
        return {s.data.unsafe_buffer_pointer() for s in array.addressable_shards}
    for path, array in _flat(critic.model).items():
        assert not pointers(array) & pointers(policy[path]), path


def test_the_reference_is_cast_into_its_own_mesh(mesh, sharded_policy):
    reference_mesh = make_mesh({"tensor": 8})
    graphdef, state = frozen_reference(sharded_policy, jnp.bfloat16, mesh=reference_mesh)
    policy = _flat(sharded_policy)
    for path, variable in nnx.to_flat_state(state):
        array = variable.get_value()
        assert array.sharding.mesh == reference_mesh, path
        if jnp.issubdtype(policy[path].dtype, jnp.floating):
            assert array.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(array), np.asarray(policy[path].astype(jnp.bfloat16)))


def test_init_sharded_matches_eager_init_for_any_module(mesh):
    def make():
        return nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    sharded, eager = init_sharded(make, mesh), make()
    np.testing.assert_allclose(np.asarray(sharded.kernel[...]), np.asarray(eager.kernel[...]), rtol=ULP2, atol=0)
