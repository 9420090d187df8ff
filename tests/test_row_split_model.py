"""Rows split by position over the mesh's 'sequence' axis (context parallelism, `models/qwen35_moe/row_split.py`).

On 8 CPU devices the tiny model's loss and gradients (every parameter and the input embeddings' cotangent through
the table) with each row split over 2 and 4 chips of 'sequence' equal the unsplit computation on one device, fp32:
rtol 1e-5 on the loss and each gradient leaf to 1e-5 of its size plus 1e-5 of the largest leaf's (the same terms
summed in another order: chunked delta-rule algebra from another entering state, key blocks gathered, a
reduce-scatter instead of a sum). Packed rows have documents that start exactly on, just before and just after a
span boundary. Cases: attention dense / blockwise / splash (interpret), gated delta chunked / pallas (interpret),
and the split beside data, fsdp and tensor axes. The zig-zag permutation is checked on its own (a round trip and
the layout each chip holds).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mercury_jax.parallel import make_mesh, shard_params, with_mesh_context
from models.qwen35_moe.config import tiny
from models.qwen35_moe.model import Qwen35MoeForCausalLM
from models.qwen35_moe.row_split import RowSplit, RowSplitError, from_split_order, row_split, to_split_order

LENGTH = 32


def _model(**overrides):
    config = tiny(vocab_size=64, dtype="float32", gdn_chunk_size=4, **{"moe_impl": "dense", **overrides})
    return Qwen35MoeForCausalLM(config, rngs=nnx.Rngs(0))


def _batch(rows, chips):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 64, size=(rows, LENGTH)).astype(np.int32)
    span = LENGTH // (2 * chips)
    cuts = [[], [span], [span - 1, 3 * span + 1], [2 * span + 1]]  # on, just before and just after boundaries
    segments = np.zeros((rows, LENGTH), np.int32)
    for r in range(rows):
        for cut in cuts[r % len(cuts)]:
            segments[r, cut:] += 1
    return jnp.asarray(ids), jnp.asarray(segments)


def _loss(graphdef, state, ids, segments):
    model = nnx.merge(graphdef, state)
    logits = model(ids, segment_ids=segments)
    logp = jax.nn.log_softmax(logits[:, :-1])
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked * jnp.arange(1, LENGTH)[None, :])  # weights: an error anywhere in the row shows


def _check(mesh_shape, rows=4, **overrides):
    chips = mesh_shape["sequence"]
    ids, segments = _batch(rows, chips)
    # the same implementations, unsplit on one device (the expert-parallel MoE needs a mesh: its math densely)
    graphdef, state = nnx.split(_model(**{**overrides, "moe_impl": "dense"}))
    want_loss, want_grads = jax.value_and_grad(_loss, argnums=1)(graphdef, state, ids, segments)

    mesh = make_mesh(mesh_shape, jax.devices()[:int(np.prod(list(mesh_shape.values())))])
    graphdef_m, state_m = nnx.split(shard_params(_model(**overrides), mesh))
    rows_spec = NamedSharding(mesh, P())
    ids_m, segments_m = jax.device_put((ids, segments), rows_spec)
    run = jax.jit(with_mesh_context(jax.value_and_grad(_loss, argnums=1), mesh), static_argnums=0)
    got_loss, got_grads = run(graphdef_m, state_m, ids_m, segments_m)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
    for (path, g_got), g_want in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads),
                                     strict=True):
        np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    # the split really happened: the program holds the collectives the split adds
    hlo = run.lower(graphdef_m, state_m, ids_m, segments_m).as_text()
    assert "collective_permute" in hlo or "collective-permute" in hlo
    return hlo


@pytest.mark.slow  # ~30-50 s of CPU each (the unsplit reference runs eager); the fast tier keeps the GDN split
@pytest.mark.parametrize("chips", [2, 4])  # (test_gated_delta_split) and the split learner (test_row_split_learner)
def test_split_rows_equal_unsplit_dense_attention_chunked_rule(chips):
    _check({"sequence": chips}, attention_impl="dense", gdn_impl="chunked")


@pytest.mark.slow
def test_split_rows_blockwise_attention_beside_fsdp_and_tensor():
    _check({"fsdp": 2, "sequence": 2, "tensor": 2}, attention_impl="blockwise", gdn_impl="chunked")


@pytest.mark.slow
def test_split_rows_with_the_expert_parallel_moe():
    """Tokens of split rows are dispatched to experts from the chip that holds them ('sequence' is a token axis)."""
    _check({"fsdp": 2, "sequence": 2, "expert": 2}, attention_impl="blockwise", gdn_impl="chunked", moe_impl="ep")


@pytest.mark.slow
def test_split_rows_blockwise_attention_four_chips_beside_data():
    _check({"data": 2, "sequence": 4}, attention_impl="blockwise", gdn_impl="chunked")


@pytest.mark.slow
@pytest.mark.parametrize("chips", [2, 4])
def test_split_rows_pallas_rule_and_splash_attention_interpreted(chips, monkeypatch):
    import models.qwen35_moe.attention as attention
    import models.qwen35_moe.split_attention as split_attention
    whole, split = attention.splash_self_attention, split_attention.splash_rows
    monkeypatch.setattr(attention, "splash_self_attention", lambda *a, **k: whole(*a, **k, interpret=True))
    monkeypatch.setattr(split_attention, "splash_rows", lambda *a, **k: split(*a, **k, interpret=True))
    _check({"sequence": chips}, attention_impl="splash", gdn_impl="pallas")


def test_the_zigzag_order_and_its_inverse():
    mesh = make_mesh({"fsdp": 2, "sequence": 4})
    split = RowSplit("sequence", 4, LENGTH)
    x = jax.device_put(jnp.arange(2 * LENGTH, dtype=jnp.int32).reshape(2, LENGTH), NamedSharding(mesh, P()))
    there = jax.jit(with_mesh_context(lambda a: to_split_order(a, split), mesh))(x)
    back = jax.jit(with_mesh_context(lambda a: from_split_order(a, split), mesh))(there)
    np.testing.assert_array_equal(back, x)
    S = split.span
    for chip in range(4):  # chip c holds spans c and 2n - 1 - c, in that order
        local = np.asarray(there)[0, chip * 2 * S:(chip + 1) * 2 * S]
        want = np.concatenate([np.arange(chip * S, chip * S + S), np.arange((7 - chip) * S, (8 - chip) * S)])
        np.testing.assert_array_equal(local, want)


def test_a_row_the_axis_cannot_split_is_refused_with_the_fix():
    mesh = make_mesh({"sequence": 4}, jax.devices()[:4])
    with pytest.raises(RowSplitError, match="pad rows to a multiple of 8"):
        with_mesh_context(lambda: row_split(36), mesh)()
    assert with_mesh_context(lambda: row_split(40), mesh)() == RowSplit("sequence", 4, 40)
    assert row_split(36) is None  # off a mesh nothing is split
