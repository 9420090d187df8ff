"""Expert-parallel MoE (moe_impl='ep') against the single-device sort + ragged_dot path on the 8-device CPU mesh.

Tolerance 1e-5 (fp32, matmul precision 'highest'): both sides do the same per-pair products; only the order of the
routed sum's additions (and, with a 'tensor' split, of the I-dim contraction) differs; observed ~2e-6 on sums of
30 x 16 terms of magnitude ~1. On CPU the dispatch is the padded all_to_all (XLA:CPU has no ragged-all-to-all).
"""
from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import hf_logits, hf_model, save_checkpoint
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.parallel.sharding import variable_sharding
from models.qwen35_moe import config as C
from models.qwen35_moe.hf import load_hf
from models.qwen35_moe.model import Qwen35MoeForCausalLM
from models.qwen35_moe.moe import SparseMoe, load_balancing_loss, routed_experts
from models.qwen35_moe.moe_ep import ExpertParallelError, ep_routed_experts, receive_capacity, round_rows

ATOL = 1e-5
N, K, E, H, F = 30, 2, 8, 16, 8  # 30 tokens: not a multiple of 8 shards, so the token padding is exercised
MESHES = {
    "expert4_data2": {"expert": 4, "data": 2},
    "expert8": {"expert": 8},
    "expert2_fsdp2_tensor2": {"expert": 2, "fsdp": 2, "tensor": 2},
}


def _routings():
    """Adversarial and random routings: [N, k] expert ids (distinct per token), each with its own k."""
    r = np.random.RandomState(0)
    random = np.stack([r.choice(E, K, replace=False) for _ in range(N)])
    return {
        "random": random,
        "all_to_last_expert": np.full((N, 1), E - 1),  # one device receives every pair; experts 0..6 unused
        "all_to_first_pair": np.tile([1, 0], (N, 1)),  # both picks on expert-rank 0 for every mesh; 2..7 unused
    }


def _weights():
    r = np.random.RandomState(1)
    x = jnp.asarray(r.randn(N, H), jnp.float32)
    experts = tuple(jnp.asarray(0.3 * r.randn(*s), jnp.float32) for s in [(E, H, F), (E, H, F), (E, F, H)])
    return x, experts


def _loss(routed, expert_NxK):
    def loss(x, w, g, u, d):
        return jnp.sum(jnp.sin(routed(x, jnp.asarray(expert_NxK, jnp.int32), w, g, u, d)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` by its documented semantics, from a dense all_to_all (XLA:CPU lacks the op):
    rows operand[input_offsets[j] : + send_sizes[j]] go to device j, landing at output[output_offsets[j] : ...] there;
    recv_sizes[s] rows arrive from device s. Lets the CPU mesh check our offset arithmetic of the ragged dispatch."""
    rows = operand.shape[0]
    index_PxR = input_offsets[:, None] + jnp.arange(rows)[None, :]
    send_PxRxH = operand[jnp.clip(index_PxR, 0, rows - 1)]
    recv_PxRxH = jax.lax.all_to_all(send_PxRxH, axis_name, 0, 0, tiled=False)
    offsets_from_P = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where source s writes in me
    valid_PxR = jnp.arange(rows)[None, :] < recv_sizes[:, None]
    target_PxR = jnp.where(valid_PxR, offsets_from_P[:, None] + jnp.arange(rows)[None, :], output.shape[0])
    return output.at[target_PxR.reshape(-1)].set(recv_PxRxH.reshape(-1, *operand.shape[1:]), mode="drop")


# case -> (mesh, round_factor, replace ragged_all_to_all by the test's own emulation). With round_factor 0.25 on
# expert=8 a round receives 2 rows (4 tokens x 2 picks x 0.25), so the 30 pairs sent to the last expert's device
# take 15 rounds of the 16 the scan holds.
CASES = {name: (shape, 2.0, False) for name, shape in MESHES.items()} | {
    "expert4_data2_ragged_emulated": (MESHES["expert4_data2"], 2.0, True),
    "expert8_two_row_rounds": (MESHES["expert8"], 0.25, False),
    "expert2_fsdp2_tensor2_ragged_emulated_one_row_rounds": (MESHES["expert2_fsdp2_tensor2"], 0.01, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ep_routed_experts_match_single_device_values_and_gradients(case, monkeypatch):
    mesh_shape, round_factor, emulate = CASES[case]
    mesh, mesh_name = make_mesh(mesh_shape), case
    dispatch = "auto"
    if emulate:
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
        dispatch = "ragged"
    x, experts = _weights()
    routings = _routings()
    weights = {name: jnp.asarray(np.random.RandomState(2).rand(N, e.shape[1]), jnp.float32)
               for name, e in routings.items()}

    def all_cases(routed):
        return {name: _loss(routed, e)(x, weights[name], *experts) for name, e in routings.items()}

    expected = jax.jit(lambda: all_cases(routed_experts))()
    with jax.set_mesh(mesh):
        got = jax.jit(lambda: all_cases(functools.partial(ep_routed_experts, dispatch=dispatch,
                                                          round_factor=round_factor)))()
    for name in routings:
        want_leaves, got_leaves = jax.tree.leaves(expected[name]), jax.tree.leaves(got[name])
        for what, want, have in zip(["loss", "d_x", "d_weight", "d_gate", "d_up", "d_down"], want_leaves,
                                    got_leaves):
            assert float(jnp.max(jnp.abs(want))) > 1e-3, f"{name} {what}: reference is zero, test cannot fail"
            np.testing.assert_allclose(np.asarray(have), np.asarray(want), atol=ATOL, rtol=0,
                                       err_msg=f"{mesh_name} {name} {what}")


def _moe_loss(moe, x_BxTxH, probe_BxTxH):
    out, aux = moe(x_BxTxH)
    num_tokens = x_BxTxH.shape[0] * x_BxTxH.shape[1]
    aux_loss = load_balancing_loss(aux["expert_counts_E"], aux["router_prob_sum_E"], num_tokens,
                                   moe.config.num_experts)
    return jnp.sum(out * probe_BxTxH) + 10.0 * aux_loss, (out, aux, aux_loss)


@nnx.jit
def _moe_value_and_grads(moe, x, probe):
    grad_fn = nnx.value_and_grad(_moe_loss, argnums=(0, 1), has_aux=True)
    (loss, (out, aux, aux_loss)), (g_moe, g_x) = grad_fn(moe, x, probe)
    return loss, out, aux, aux_loss, g_x, g_moe


@pytest.mark.parametrize("mesh_shape", [{"expert": 8}, {"expert": 2, "fsdp": 2, "tensor": 2}])
def test_sparse_moe_ep_matches_ragged_layer_with_aux_and_router_gradients(mesh_shape):
    """The whole layer (router, top-k, shared expert, aux stats) with moe_impl='ep' on a mesh vs 'ragged' on one
    device; second case: a zero router, so every token ties on all experts and top-k picks experts 0 and 1."""
    mesh = make_mesh(mesh_shape)
    cfg = C.tiny(hidden_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    r = np.random.RandomState(3)
    x = jnp.asarray(r.randn(2, 11, 16), jnp.float32)  # 22 tokens: padded to 24 on 8 shards, aux must ignore pads
    probe = jnp.asarray(r.randn(2, 11, 16), jnp.float32)
    for tie in (False, True):
        reference = SparseMoe(cfg, rngs=nnx.Rngs(0))
        ep = SparseMoe(C.tiny(hidden_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                              moe_impl="ep"), rngs=nnx.Rngs(0))
        if tie:
            for moe in (reference, ep):
                moe.router.set_value(jnp.zeros_like(moe.router.get_value()))
        want = _moe_value_and_grads(reference, x, probe)
        shard_params(ep, mesh)
        with jax.set_mesh(mesh):
            got = _moe_value_and_grads(ep, x, probe)
        if tie:
            assert np.all(np.asarray(want[2]["expert_counts_E"])[2:] == 0), "ties must pick experts 0 and 1"
        names = ["loss", "out", "aux", "aux_loss", "d_x"]
        for name, a, b in zip(names, want[:5], got[:5]):
            for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=ATOL, rtol=0, err_msg=f"{tie} {name}")
        grads_want = jax.tree_util.tree_leaves_with_path(want[5])
        grads_got = jax.tree.leaves(got[5])
        assert any("router" in jax.tree_util.keystr(p) for p, _ in grads_want)
        for (path, a), b in zip(grads_want, grads_got):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=ATOL, rtol=0,
                                       err_msg=f"tie={tie} grad {jax.tree_util.keystr(path)}")


def test_ep_needs_a_mesh_and_a_dividing_expert_axis():
    x, (g, u, d) = _weights()
    e = jnp.zeros((N, K), jnp.int32)
    w = jnp.ones((N, K), jnp.float32)
    with pytest.raises(ExpertParallelError, match="jax.set_mesh"):
        ep_routed_experts(x, e, w, g, u, d)
    with pytest.raises(ExpertParallelError, match="not divisible"):
        ep_routed_experts(x, e, w, g[:6], u[:6], d[:6], mesh=make_mesh({"expert": 4, "data": 2}))
    assert receive_capacity(tokens_per_device=5, top_k=8, experts_per_device=2) == 10
    with pytest.raises(ExpertParallelError, match="round_factor"):
        ep_routed_experts(x, e, w, g, u, d, mesh=make_mesh({"expert": 4, "data": 2}), round_factor=0)
    with pytest.raises(ValueError, match="moe_ep_round_factor"):
        C.tiny(moe_impl="ep", moe_ep_round_factor=0)


def test_round_rows_are_flat_in_the_expert_axis():
    """B = ceil(factor * n * K) whatever P; the round count covers the worst case P * n * min(K, E_local)."""
    for ep_size in (4, 8, 16, 32):
        rows, rounds = round_rows(tokens_per_device=4096, top_k=8, experts_per_device=256 // ep_size,
                                  ep_size=ep_size)
        assert rows == 2 * 4096 * 8
        assert rounds == -(-ep_size * 4096 * min(8, 256 // ep_size) // rows)
    assert round_rows(tokens_per_device=4, top_k=2, experts_per_device=8, ep_size=1) == (8, 1)  # capped at worst
    assert round_rows(tokens_per_device=4, top_k=2, experts_per_device=1, ep_size=8, round_factor=0.25) == (2, 16)


@pytest.mark.parametrize("mesh_shape", [None, {"expert": 4, "fsdp": 2}])
def test_hf_parity_with_ep_on_one_and_eight_devices(tmp_path, mesh_shape):
    cfg = C.tiny(vocab_size=96, num_hidden_layers=4, full_attention_interval=4)
    reference = hf_model(cfg, seed=0)
    path = save_checkpoint(reference, tmp_path / "ckpt", experts="fused", prefix="model.")
    ids = np.random.RandomState(1).randint(0, 96, size=(2, 45))  # 90 tokens: padded to 96 on 8 shards
    want = hf_logits(reference, ids)
    mesh = make_mesh(devices=jax.devices()[:1]) if mesh_shape is None else make_mesh(mesh_shape)
    model = load_hf(path, mesh=mesh, moe_impl="ep")
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, t: m(t))(model, ids)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


def _compiled_model_hlo(devices, mesh_shape, batch, seq, moe_impl="ep"):
    """Compiled HLO text of a 2-layer model's forward + backward (1 GDN + 1 attention layer, each with the MoE;
    parameters sharded by their names, rows over the mesh), loss = mean log-prob proxy + the aux loss."""
    mesh = make_mesh(mesh_shape, devices=devices)
    cfg = C.tiny(vocab_size=80, num_hidden_layers=2, full_attention_interval=2, hidden_size=64,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16, moe_impl=moe_impl)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(state)
    params = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=variable_sharding(p, v, mesh)) for p, v in flat]
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                               sharding=NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"))))

    def loss(arrays, ids_BxT):
        model = nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(a)) for (p, v), a in zip(flat, arrays)]))
        hidden_BxTxH, aux = model.hidden_states(ids_BxT)
        return jnp.mean(model.logits(hidden_BxTxH) ** 2) + model.aux_loss(aux)

    step = jax.jit(jax.grad(loss), out_shardings=[p.sharding for p in params])
    with jax.set_mesh(mesh):
        return step.lower(params, ids).compile().as_text()


def _tpu_devices():
    try:
        import libtpu  # noqa: F401
        from jax.experimental import topologies
        return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2").devices
    except Exception as error:  # noqa: BLE001 (any failure to load the TPU compiler means: skip)
        pytest.skip(f"libtpu not importable ({type(error).__name__}); run with PYTHONPATH=<dir with libtpu>")


@pytest.mark.slow  # ~30 s of CPU (the CPU case; the TPU case skips without libtpu)
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_compiled_hlo_dispatches_by_all_to_all_without_global_collectives(platform, moe_impl="ep"):
    """A 2-layer model's forward + backward (embedding, GDN, attention, EP MoE, logits, aux loss) on 4 chips
    (expert=2, fsdp=2) vs 8 chips (data=2 more) at 12 tokens per chip, the parameters laid out identically: the
    dispatch is an all-to-all (ragged on TPU) of identical shape, no all-gather yields all E experts, and no
    collective of the 8-chip program has a size that is a multiple of its global token count (96) unless the same
    shape already appears in the 4-chip program (half the global tokens): nothing scales with the global batch."""
    devices = _tpu_devices() if platform == "tpu" else jax.devices()
    small = collectives(_compiled_model_hlo(devices[:4], {"expert": 2, "fsdp": 2}, 4, 12, moe_impl))
    large = collectives(_compiled_model_hlo(devices, {"data": 2, "expert": 2, "fsdp": 2}, 8, 12, moe_impl))
    dispatch_op = "ragged-all-to-all" if platform == "tpu" else "all-to-all"
    dispatch_large, dispatch_small = ([c for c in cs if c[0] == dispatch_op and "f32" in c[1]] for cs in (large, small))
    assert dispatch_large, f"no float {dispatch_op} in the compiled program: {large}"
    assert dispatch_large == dispatch_small, "the dispatch buffers must not grow with the global token count"
    num_experts, global_tokens = 16, 8 * 12
    small_shapes = {shape for _, shape in small}
    for op, shape in large:
        for dims in re.findall(r"\[([\d,]*)\]", shape):
            dims = [int(d) for d in dims.split(",") if d]
            assert not (op == "all-gather" and len(dims) == 3 and dims[0] == num_experts), \
                f"all-gather of every expert's weights: {op} {shape}"
            size = math.prod(dims)
            assert size % global_tokens or shape in small_shapes or size < global_tokens, \
                f"{op} {shape} scales with the global token count {global_tokens}"


_COLLECTIVE = re.compile(r"=\s*(\S.*?)\s+(all-gather|all-reduce|all-to-all|ragged-all-to-all|reduce-scatter|"
                         r"collective-permute)(?:-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, str]]:
    """(op, result shape) of every cross-device collective in compiled HLO text."""
    return sorted((m.group(2), re.sub(r"\{[^}]*\}", "", m.group(1))) for m in _COLLECTIVE.finditer(hlo_text))
