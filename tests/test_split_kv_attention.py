"""The K/V cache split by sequence over tensor (models/qwen35_moe/split_kv_attention.py) against the whole cache.

- The cached attention alone, fp32, on tensor = 2, 4, 8 (8: the query heads do not divide the axis, so the chips
  all-reduce instead of reduce-scattering) and data 2 x tensor 4: outputs and written caches against
  `attention.whole_kv_cached_attention`, for rows whose next positions start on, just before and just after a chip
  boundary, a chunk of T = 5 that straddles one, a row whose later chips see nothing, and dropped writes of padding
  tokens (each row's real tokens a prefix, as in a prefill; a padding token's output is discarded by every caller,
  so only real tokens' outputs are compared). Tolerance 1e-6 absolute on unit-scale outputs: the sum over positions
  runs in another order (chip by chip, then the new tokens).
- The rollout engine with 1 KV head on replicas of tensor 2, 4 (and 8, slow): the same greedy tokens as the
  single-device engine, log-probs within 1e-5 (fp32), first turns and continuations on a kept cache; the K/V really
  sit split by position; the compiled decode program holds no whole-cache all-gather.
- bf16: a tensor=4 replica on bf16 weights against a single-device engine on the same bf16 weights, tokens equal
  and log-probs within 1e-3 (the tolerance of the existing bf16 replica test).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mercury_jax.parallel import make_mesh, with_mesh_context
from mercury_jax.rollout import Engine, EngineSettings, ReplicatedEngine, Request, replica_meshes
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C
from models.qwen35_moe.attention import whole_kv_cached_attention
from models.qwen35_moe.split_kv_attention import kv_split_axis, split_kv_cached_attention

S, K, N, D = 48, 1, 4, 8


def _inputs(T: int, starts: list[int], seed: int = 0):
    rng = np.random.RandomState(seed)
    B = len(starts)
    arr = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)  # noqa: E731
    cache = {"k": arr(B, S, K, D), "v": arr(B, S, K, D)}
    start_B = jnp.asarray(starts, jnp.int32)
    write_BxT = start_B[:, None] + jnp.arange(T)[None, :]
    lengths_B = rng.randint(1, T + 1, size=B)  # the first lengths[b] tokens of a row are real, as in a prefill
    valid_BxT = jnp.arange(T)[None, :] < jnp.asarray(lengths_B)[:, None]
    write_BxT = jnp.where(valid_BxT, write_BxT, S)
    return arr(B, T, N, D), arr(B, T, K, D), arr(B, T, K, D), cache, write_BxT, start_B[:, None] + jnp.arange(T)


def _real(out_BxTxNxD, write_BxT):
    """The outputs of the real tokens (a padding token's output is discarded by every caller)."""
    return np.where(np.asarray(write_BxT < S)[..., None, None], out_BxTxNxD, 0.0)


@pytest.mark.parametrize("shape", [{"tensor": 2}, {"tensor": 4}, {"tensor": 8}, {"data": 2, "tensor": 4}])
@pytest.mark.parametrize("T", [1, 5])
def test_split_cached_attention_equals_the_whole_cache(shape, T):
    mesh = make_mesh(shape, devices=jax.devices()[:int(np.prod(list(shape.values())))])
    assert kv_split_axis(K, S, mesh) == "tensor"
    span = S // shape["tensor"]
    # on a boundary, just before / after one, straddling one with T = 5, row 0 sees only chip 0, the last row all
    starts = [0, span - 1, span, span + 1, span - 3, 2 * span - 2, S - T - 1, S - T]
    args = _inputs(T, starts)
    want_out, want_cache = whole_kv_cached_attention(*args)
    run = jax.jit(with_mesh_context(lambda *a: split_kv_cached_attention(*a, mesh), mesh))
    got_out, got_cache = run(*args)
    np.testing.assert_allclose(_real(got_out, args[4]), _real(want_out, args[4]), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(got_cache["k"], want_cache["k"])
    np.testing.assert_array_equal(got_cache["v"], want_cache["v"])
    assert got_cache["k"].sharding.spec[1] == "tensor"


@pytest.mark.parametrize("split", [False, True])
def test_a_layer_of_a_stacked_cache_is_read_and_written_in_place(split):
    """The decode scan carries every layer's K/V ([L, B, S, K, D]) and hands a layer its index: writing and
    attending at that index equals the same call on the layer's own cache, and leaves the other layers alone."""
    mesh = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    starts = [0, 11, 12, 13, 40]
    query, key, value, cache, write, query_index = _inputs(5, starts, seed=3)
    other = _inputs(5, starts, seed=4)[3]
    stack = {name: jnp.stack([other[name], cache[name], -other[name]]) for name in ("k", "v")}
    want_out, want_cache = whole_kv_cached_attention(query, key, value, cache, write, query_index)
    if split:
        fn = jax.jit(with_mesh_context(lambda *a: split_kv_cached_attention(*a, mesh), mesh))
    else:
        fn = jax.jit(whole_kv_cached_attention)
    got_out, got_stack = fn(query, key, value, dict(stack, layer=jnp.int32(1)), write, query_index)
    np.testing.assert_allclose(_real(got_out, write), _real(want_out, write), atol=1e-6, rtol=1e-6)
    for name in ("k", "v"):
        np.testing.assert_array_equal(got_stack[name][1], want_cache[name])
        np.testing.assert_array_equal(got_stack[name][0], stack[name][0])
        np.testing.assert_array_equal(got_stack[name][2], stack[name][2])


def test_the_split_applies_only_where_heads_do_not_divide():
    mesh4 = make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    assert kv_split_axis(2, 48, mesh4) == "tensor"  # 35B-A3B's case: 2 kv heads, tensor 4
    assert kv_split_axis(4, 48, mesh4) is None  # heads divide: split by head
    assert kv_split_axis(2, 50, mesh4) is None  # length does not divide: whole
    assert kv_split_axis(2, 48, make_mesh({"data": 4}, devices=jax.devices()[:4])) is None
    assert kv_split_axis(2, 48, None) is None


VOCAB, MAX_LEN, SLOTS = 80, 48, 4
PROMPTS = [[int(t) for t in np.random.RandomState(i).randint(1, VOCAB, size=n)] for i, n in enumerate([3, 13, 12, 25])]
OBSERVATIONS = [[int(t) for t in np.random.RandomState(50 + i).randint(1, VOCAB, size=n)] for i, n in
                enumerate([9, 2, 4, 3])]


@pytest.fixture(scope="module")
def model():
    # one scanned block of 1 GDN + 1 attention layer, one KV head for 4 query heads
    return Qwen35MoeForCausalLM(C.tiny(vocab_size=VOCAB, num_hidden_layers=2, full_attention_interval=2,
                                       num_key_value_heads=1), rngs=nnx.Rngs(5))


def two_turns(engine) -> dict:
    """Four greedy first turns kept in their slots (prompts of 3 to 25 tokens: prefills that cross chip spans),
    then a continuation of each on its kept cache."""
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Request(i, prompt, max_new_tokens=7, temperature=0.0, keep_cache=True))
    engine.run()
    for i, observation in enumerate(OBSERVATIONS):
        engine.submit(Request(100 + i, observation, max_new_tokens=5, temperature=0.0, continue_from=i))
    return {rid: (s.tokens, s.logprobs) for rid, s in engine.run().items()}


@pytest.fixture(scope="module")
def reference(model):
    return two_turns(Engine(model, num_slots=SLOTS, max_length=MAX_LEN))


@pytest.mark.slow  # ~50 s of CPU with its reference engine; the split attention itself stays in the fast tier above
@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_a_replica_with_split_kv_decodes_like_one_device(model, reference, tensor):
    mesh = make_mesh({"tensor": tensor}, devices=jax.devices()[:tensor])
    engine = Engine(model, num_slots=SLOTS, max_length=MAX_LEN, mesh=mesh)
    got = two_turns(engine)
    assert sorted(got) == sorted(reference)
    for rid, (tokens, logprobs) in reference.items():
        assert got[rid][0] == tokens, rid
        np.testing.assert_allclose(got[rid][1], logprobs, atol=1e-5, err_msg=str(rid))
    k = engine.state["cache"]["blocks"][1]["k"]  # [layers, slots, S, K, D]: positions over tensor
    assert tuple(k.sharding.spec)[:3] == (None, None, "tensor")
    assert k.addressable_shards[0].data.shape[2] == MAX_LEN // tensor
    params, _ = engine.sampler._weights
    hlo = engine.sampler._decode.lower(params, engine.state, 8).compile().as_text()
    kv_bytes = k.nbytes
    gathered = [line for line in hlo.splitlines() if "all-gather" in line and "=" in line]
    assert all(_result_bytes(line) < kv_bytes // tensor for line in gathered), gathered


def _result_bytes(hlo_line: str) -> int:
    """Bytes of the first array shape on an HLO instruction line (its result), e.g. f32[2,12,1,16]."""
    import re
    match = re.search(r"(f32|bf16|s32|pred)\[([\d,]*)\]", hlo_line)
    size = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}[match.group(1)]
    dims = [int(d) for d in match.group(2).split(",") if d]
    return size * int(np.prod(dims))


@pytest.mark.slow
def test_a_bf16_split_replica_decodes_like_a_bf16_engine(model):
    bf16 = nnx.clone(model)
    nnx.update(bf16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(bf16)))
    reference = Engine(bf16, num_slots=SLOTS, max_length=MAX_LEN)
    engine = ReplicatedEngine(model, EngineSettings(num_slots=SLOTS * 2, max_length=MAX_LEN, param_dtype="bfloat16",
                                                    replicas=replica_meshes(jax.devices(), {"tensor": 4})))
    for e in (reference, engine):
        for i, prompt in enumerate(PROMPTS):
            e.submit(Request(i, prompt, max_new_tokens=6, temperature=0.0))
    want, got = reference.run(), engine.run()
    for rid in want:
        assert got[rid].tokens == want[rid].tokens
        np.testing.assert_allclose(got[rid].logprobs, want[rid].logprobs, atol=1e-3)
