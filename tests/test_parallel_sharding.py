"""Mesh construction and logical-axis sharding of the model on the 8-device CPU test mesh."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from hf_reference import hf_model, save_checkpoint
from jax.sharding import PartitionSpec

from mercury_jax.parallel import logical_partition_spec, make_mesh, shard_params
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.hf import load_hf


def test_make_mesh_shapes_and_errors():
    mesh = make_mesh({"expert": 4, "tensor": 2})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "sequence": 1, "expert": 4, "tensor": 2}
    assert dict(make_mesh({"data": -1, "tensor": 2}).shape)["data"] == 4
    with pytest.raises(ValueError, match="needs 6 devices but 8"):
        make_mesh({"expert": 3, "tensor": 2})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"model": 8})


def test_logical_specs_follow_rules_and_replicate_what_does_not_divide():
    mesh = make_mesh({"expert": 4, "tensor": 2})
    assert logical_partition_spec(("experts", "embed", "expert_mlp"), (8, 64, 32), mesh) == \
        PartitionSpec("expert", None, "tensor")
    assert logical_partition_spec(("embed", "heads", "head_dim"), (64, 3, 16), mesh) == PartitionSpec(None, None, None)
    assert logical_partition_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 64, 2, 16), mesh) == \
        PartitionSpec(None, None, "tensor", None)


@nnx.jit
def _forward(model, ids):
    return model(ids)


def test_sharded_model_computes_the_same_logits():
    mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})
    model = Qwen35MoeForCausalLM(C.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    ids = np.random.RandomState(0).randint(0, 64, size=(2, 33))
    expected = np.asarray(_forward(model, ids))
    shard_params(model, mesh)
    expert_kernel = model.model.blocks.layers[0].moe.expert_gate[...]
    assert expert_kernel.sharding.spec == PartitionSpec(None, "expert", "fsdp", "tensor")
    with jax.set_mesh(mesh):
        got = np.asarray(_forward(model, ids))
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_load_hf_places_parameters_on_the_mesh(tmp_path):
    mesh = make_mesh({"expert": 4, "tensor": 2})
    path = save_checkpoint(hf_model(C.tiny(vocab_size=64)), tmp_path / "ckpt", experts="fused", prefix="model.")
    model = load_hf(path, mesh=mesh)
    assert model.model.blocks.layers[0].moe.expert_down[...].sharding.spec == \
        PartitionSpec(None, "expert", "tensor", None)
    assert model.lm_head[...].sharding.spec == PartitionSpec(None, "tensor")
