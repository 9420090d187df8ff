"""Decode-size MoE: each pick's experts gathered (`moe.picked_experts`) instead of a grouped matmul over all of them.

- `picked_experts` equals `routed_experts` (fp32, 1e-6: the same products, another order of the k-sum), and its
  stacked form (weights [L, E, ...], gathered at (layer, expert)) equals the per-layer form on that layer's slice.
- A model whose decode steps take the picked path (16 experts, top 2, 3 rows: 6 picks) gives the full forward's
  logits at every step (1e-5, the decode tests' tolerance), through the scanned blocks (stacked gather) and an
  unscanned tail layer (per-layer gather).
- The Pallas kernel (mercury_kernels/picked_experts, interpret mode here) equals the XLA gather (fp32, 1e-5: its
  products run per pick in another order), stacked and per layer, with picks shared by several tokens; and per
  shard on a tensor=4 mesh, the intermediate dim split and the partial outputs summed.
- The path is chosen by size (off TPU fewer picks than experts, on TPU up to 4 E), never for moe_impl "dense" nor on
  a mesh that splits the experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mercury_jax.parallel import make_mesh, with_mesh_context
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.moe import routed_experts
from models.qwen35_moe.moe_picked import picked_experts, reads_picked_experts


def _experts(L=None, E=8, H=16, inner=12, seed=0):
    rng = np.random.RandomState(seed)
    lead = () if L is None else (L,)
    shapes = [(E, H, inner), (E, H, inner), (E, inner, H)]
    return tuple(jnp.asarray(rng.randn(*lead, *shape), jnp.float32) for shape in shapes)


def test_picked_experts_equal_the_grouped_matmul():
    rng = np.random.RandomState(1)
    N, K, E, H = 5, 3, 8, 16
    x = jnp.asarray(rng.randn(N, H), jnp.float32)
    picks = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.rand(N, K), jnp.float32)
    gate, up, down = _experts(E=E, H=H)
    np.testing.assert_allclose(picked_experts(x, picks, weights, gate, up, down),
                               routed_experts(x, picks, weights, gate, up, down), atol=1e-6, rtol=1e-6)
    stacks = _experts(L=4, E=E, H=H, seed=2)
    for layer in range(4):
        want = picked_experts(x, picks, weights, *(s[layer] for s in stacks))
        got = jax.jit(picked_experts)(x, picks, weights, *stacks, layer=jnp.int32(layer))
        np.testing.assert_array_equal(got, want)


def test_the_pallas_kernel_equals_the_gather():
    rng = np.random.RandomState(5)
    N, K, E, H = 13, 2, 4, 128  # 26 picks of 4 experts (each by several tokens), tokens in two 8-row groups
    x = jnp.asarray(rng.randn(N, H), jnp.float32)
    picks = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.rand(N, K), jnp.float32)
    stacks = _experts(L=3, E=E, H=H, inner=256, seed=6)
    # outputs ~1e3 (unit-variance weights): fp32 sums in another order round at ~1e-4 absolute, so the absolute
    # tolerance is relative to the largest output
    close = lambda got, want: np.testing.assert_allclose(  # noqa: E731
        got, want, atol=1e-6 * float(jnp.max(jnp.abs(want))), rtol=1e-5)
    for layer in (0, 2):
        close(picked_experts(x, picks, weights, *stacks, layer=jnp.int32(layer), impl="pallas"),
              picked_experts(x, picks, weights, *stacks, layer=jnp.int32(layer), impl="gather"))
    one = tuple(s[1] for s in stacks)
    close(picked_experts(x, picks, weights, *one, impl="pallas"), picked_experts(x, picks, weights, *one,
                                                                                  impl="gather"))
    mesh = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    placed = jax.device_put((x, picks, weights, *stacks), jax.sharding.NamedSharding(mesh, P()))  # as an engine's
    sharded = jax.jit(with_mesh_context(lambda *a: picked_experts(*a, layer=jnp.int32(2), impl="pallas"), mesh))(
        *placed)
    close(sharded, picked_experts(x, picks, weights, *stacks, layer=jnp.int32(2), impl="gather"))


@pytest.mark.slow  # ~20 s of CPU; the picked experts themselves stay in the fast tier above
def test_decode_on_the_picked_path_equals_the_full_forward():
    cfg = C.tiny(vocab_size=80, num_hidden_layers=3, full_attention_interval=2, num_experts=16, scan_layers=True)
    assert cfg.block_layout()[1] == 1 and len(cfg.block_layout()[2]) == 1  # one scanned block + a tail layer
    assert reads_picked_experts(3, cfg) and not reads_picked_experts(8, cfg)
    model = Qwen35MoeForCausalLM(cfg, rngs=nnx.Rngs(4))
    rng = np.random.RandomState(3)
    seqs = rng.randint(0, 80, size=(3, 20))
    extend = nnx.jit(lambda m, ids, cache: m.extend(ids, cache))
    logits, cache = extend(model, jnp.asarray(seqs[:, :12]), model.init_cache(3, 32))  # 36 tokens: grouped path
    steps = [logits[:, -1]]
    for t in range(12, 20):
        logits, cache = extend(model, jnp.asarray(seqs[:, t:t + 1]), cache)  # 3 tokens, 6 picks of 16: picked
        steps.append(logits[:, 0])
    full = nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray(seqs))
    np.testing.assert_allclose(np.stack(steps, axis=1)[:, :-1], full[:, 11:19], atol=1e-5, rtol=0)


def test_the_grouped_path_where_picks_do_not_pay():
    """A mesh that splits the experts, moe_impl "dense", and (off TPU) as many picks as experts keep the grouped
    path; on TPU the kernel takes up to 4 E picks (tracing for TPU is what `target_platform` reads)."""
    cfg = C.tiny(num_experts=16)
    mesh = make_mesh({"expert": 2}, devices=jax.devices()[:2])
    assert with_mesh_context(lambda: reads_picked_experts(1, cfg), mesh)() is False
    assert with_mesh_context(lambda: reads_picked_experts(1, cfg), make_mesh({"tensor": 2},
                                                                             devices=jax.devices()[:2]))()
    assert not reads_picked_experts(1, C.tiny(num_experts=16, moe_impl="dense"))  # the CPU test path stays dense
