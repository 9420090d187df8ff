"""Gated delta rule: recurrent and chunked forms against a float64 loop, each other, packed documents and HF torch.

Tolerances: the kernels run in float32 (eps 6e-8) against a float64 loop. Each step is a contraction on the state
(e^g <= 1, and I - beta k k^T has norm <= 1 for unit k and beta in (0, 1)), so rounding errors do not grow with T;
observed errors are ~1e-7 to 3e-7 on O(1) values (both forms), and rtol = atol = 1e-5 leaves wide headroom while a
wrong mask, decay or reset produces O(0.1) errors. Gradients sum many terms, so they get 1e-4.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gated_delta_cases import make_inputs as shared_inputs
from gated_delta_cases import naive_gated_delta, segments

from mercury_kernels.gated_delta import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    gated_delta_step,
    recurrent_gated_delta_rule,
)

BATCH, HEADS, KEY_DIM, VALUE_DIM = 2, 3, 8, 16
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
IMPLS = ["chunked", "recurrent"]

_rule = jax.jit(gated_delta_rule, static_argnames=("impl", "chunk_size"))
_step = jax.jit(gated_delta_step)


def make_inputs(seed, batch=BATCH, time=20, heads=HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM):
    """`gated_delta_cases.make_inputs` with this file's default shapes."""
    return shared_inputs(seed, batch, time, heads, key_dim, value_dim)


def run(x, impl, initial_state=None, segment_ids=None, chunk_size=64):
    return _rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state_BxHxKxV=initial_state,
                 segment_ids_BxT=segment_ids, impl=impl, chunk_size=chunk_size)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("time", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_matches_naive_loop(impl, time, with_initial_state):
    x = make_inputs(time, time=time)
    initial_state = x["initial_state"] if with_initial_state else None
    out, final = run(x, impl, initial_state)
    want_out, want_final = naive_gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state)
    assert out.dtype == jnp.float32 and final.dtype == jnp.float32
    assert out.shape == (BATCH, time, HEADS, VALUE_DIM) and final.shape == (BATCH, HEADS, KEY_DIM, VALUE_DIM)
    np.testing.assert_allclose(out, want_out, **TOLERANCE)
    np.testing.assert_allclose(final, want_final, **TOLERANCE)


# T = 130, C = 64. Row 0: documents start at 0, 63, 64 (a chunk boundary), 65 and 128 (a chunk boundary, in the last,
# padded chunk). Row 1: starts at 0, 64 and 128, with id 7 reused for two separate documents.
PACKED_LENGTHS = [[63, 1, 1, 63, 2], [64, 64, 2]]
PACKED_IDS = [[0, 1, 2, 3, 4], [7, 3, 7]]


@pytest.mark.parametrize("impl,chunk_size", [("chunked", 64), ("chunked", 16), ("recurrent", 64)])
def test_packed_row_equals_documents_run_separately(impl, chunk_size):
    x = make_inputs(1, time=130)
    segment_ids = segments(PACKED_LENGTHS, PACKED_IDS)
    out, final = run(x, impl, x["initial_state"], segment_ids, chunk_size)

    # Every document becomes its own batch row, starting at position 0 and right-padded to T with g = beta = 0 steps
    # (which change neither the earlier outputs nor the state), so all of them run in one call.
    names = ("q", "k", "v", "g", "beta")
    docs = {name: [] for name in names + ("initial_state",)}
    spans = []
    for b, lengths in enumerate(PACKED_LENGTHS):
        start = 0
        for length in lengths:
            for name in names:
                padded = np.zeros_like(x[name][b])
                padded[:length] = x[name][b, start:start + length]
                docs[name].append(padded)
            # The initial state belongs to the document at position 0 only; the others start from zero.
            docs["initial_state"].append(x["initial_state"][b] * (start == 0))
            spans.append((b, start, length))
            start += length
    docs = {name: np.stack(rows) for name, rows in docs.items()}
    doc_out, doc_final = run(docs, impl, docs["initial_state"], chunk_size=chunk_size)
    for row, (b, start, length) in enumerate(spans):
        np.testing.assert_allclose(out[b, start:start + length], doc_out[row, :length], **TOLERANCE)
        if start + length == out.shape[1]:
            np.testing.assert_allclose(final[b], doc_final[row], **TOLERANCE)

    want_out, want_final = naive_gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
                                             segment_ids)
    np.testing.assert_allclose(out, want_out, **TOLERANCE)
    np.testing.assert_allclose(final, want_final, **TOLERANCE)


@pytest.mark.parametrize("impl", IMPLS)
def test_strong_decay_keeps_float32_accuracy(impl):
    """Slow decay (g near 0) punctuated by g = -200: |Gamma| reaches ~10^3 within a chunk while nearby decays stay
    near 1. Forming Gamma_r - Gamma_s by subtracting cumsums would cost ~eps * 10^3 ~ 1e-4 here; the kernels must
    stay at float32 rounding level (observed ~2e-7), hence the tight 2e-6."""
    x = make_inputs(10, time=128)
    rng = np.random.default_rng(11)
    x["g"] = rng.uniform(-0.05, 0.0, size=x["g"].shape).astype(np.float32)
    x["g"][:, ::9] = -200.0
    out, final = run(x, impl, x["initial_state"])
    want_out, want_final = naive_gated_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    np.testing.assert_allclose(out, want_out, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(final, want_final, rtol=2e-6, atol=2e-6)


def test_chunked_final_state_equals_recurrent():
    x = make_inputs(2, time=100)
    segment_ids = segments([[30, 70], [100]], [[0, 1], [0]])
    chunked_out, chunked_final = run(x, "chunked", x["initial_state"], segment_ids, chunk_size=32)
    recurrent_out, recurrent_final = run(x, "recurrent", x["initial_state"], segment_ids)
    np.testing.assert_allclose(chunked_final, recurrent_final, **TOLERANCE)
    np.testing.assert_allclose(chunked_out, recurrent_out, **TOLERANCE)


def test_step_repeated_equals_recurrent_scan():
    x = make_inputs(3, time=7)
    state = jnp.asarray(x["initial_state"])
    outs = []
    for t in range(7):
        out_t, state = _step(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], state)
        outs.append(out_t)
    want_out, want_final = run(x, "recurrent", x["initial_state"])
    np.testing.assert_allclose(np.stack(outs, axis=1), want_out, **TOLERANCE)
    np.testing.assert_allclose(state, want_final, **TOLERANCE)


@pytest.mark.parametrize("impl", IMPLS)
def test_two_halves_equal_the_whole(impl):
    x = make_inputs(4, time=130)
    split = 70  # not a multiple of the chunk size, so the first half's padding is exercised
    first = {name: a[:, :split] for name, a in x.items() if name != "initial_state"}
    second = {name: a[:, split:] for name, a in x.items() if name != "initial_state"}
    first_out, first_final = run(first, impl, x["initial_state"])
    second_out, second_final = run(second, impl, first_final)
    whole_out, whole_final = run(x, impl, x["initial_state"])
    np.testing.assert_allclose(np.concatenate([first_out, second_out], axis=1), whole_out, **TOLERANCE)
    np.testing.assert_allclose(second_final, whole_final, **TOLERANCE)


@pytest.mark.parametrize("with_segments", [False, True])
def test_chunked_gradients_match_recurrent(with_segments):
    x = make_inputs(5, batch=1, time=21, heads=2, key_dim=4, value_dim=4)
    segment_ids = segments([[9, 12]], [[0, 1]]) if with_segments else None
    rng = np.random.default_rng(6)
    out_weight = rng.normal(size=(1, 21, 2, 4)).astype(np.float32)
    state_weight = rng.normal(size=(1, 2, 4, 4)).astype(np.float32)

    def loss(fn, q, k, v, g, beta, initial_state):
        out, final = fn(q, k, v, g, beta, initial_state_BxHxKxV=initial_state, segment_ids_BxT=segment_ids)
        return jnp.sum(out * out_weight) + jnp.sum(final * state_weight)

    args = [x[name] for name in ("q", "k", "v", "g", "beta", "initial_state")]
    chunked = lambda *a, **kw: chunked_gated_delta_rule(*a, **kw, chunk_size=8)  # 3 chunks, last one padded
    grads_chunked = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=range(6)))(*args)
    grads_recurrent = jax.jit(jax.grad(lambda *a: loss(recurrent_gated_delta_rule, *a), argnums=range(6)))(*args)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), grads_chunked, grads_recurrent):
        assert np.all(np.isfinite(got)), name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d loss / d {name}")


def test_matches_hf_torch_chunk_gated_delta_rule():
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    x = make_inputs(7, batch=2, time=100, heads=4, key_dim=16, value_dim=16)
    # HF always scales q by K^-0.5 itself (and would L2-normalise only with use_qk_l2norm_in_kernel=True), so it gets
    # the unit-norm q and we get the scaled one.
    unit_q = x["q"] * 16 ** 0.5
    want_out, want_final = modeling.torch_chunk_gated_delta_rule(
        *(torch.from_numpy(a) for a in (unit_q, x["k"], x["v"], x["g"], x["beta"])), chunk_size=64,
        initial_state=torch.from_numpy(x["initial_state"]), output_final_state=True, use_qk_l2norm_in_kernel=False)
    for impl in IMPLS:
        out, final = run(x, impl, x["initial_state"])
        np.testing.assert_allclose(out, want_out.numpy(), **TOLERANCE)
        np.testing.assert_allclose(final, want_final.numpy(), **TOLERANCE)


def test_low_precision_inputs_give_float32_outputs():
    """bf16 inputs are upcast and every step runs in float32: the outputs equal the float64 loop on the same
    (bf16-rounded) inputs to float32 rounding, not to bf16 rounding (~4e-3 relative)."""
    x = {name: jnp.asarray(a, jnp.bfloat16) for name, a in make_inputs(8, time=5).items()}
    rounded = {name: np.asarray(a.astype(jnp.float32)) for name, a in x.items()}
    want_out, want_final = naive_gated_delta(rounded["q"], rounded["k"], rounded["v"], rounded["g"],
                                             rounded["beta"], rounded["initial_state"])
    for impl in IMPLS:
        out, final = run(x, impl, x["initial_state"])
        assert out.dtype == jnp.float32 and final.dtype == jnp.float32
        np.testing.assert_allclose(out, want_out, **TOLERANCE, err_msg=impl)
        np.testing.assert_allclose(final, want_final, **TOLERANCE, err_msg=impl)


def test_unknown_impl_names_the_valid_ones():
    x = make_inputs(9, time=3)
    with pytest.raises(ValueError, match="chunked.*recurrent"):
        gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], impl="pallas_typo")
