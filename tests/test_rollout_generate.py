"""`generate` and the engine against the full forward: greedy = step-by-step argmax of model(prefix), recorded
log-probs = log_softmax of model(prefix), batch independence, stop tokens and budgets, top-k / top-p sets,
continuations with and without a kept cache, slot reuse.

Tolerance 1e-5 (fp32) wherever the cached decode is compared with the full forward or a 1-slot run with a
multi-slot run: the same sums in another order (recurrent GDN step vs chunked form, attention over a zero-padded
cache, a 1-row vs an n-row matmul). Tokens are compared exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mercury_jax.rollout import Engine, Request, generate
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C

ATOL = 1e-5
VOCAB = 80  # differs from the hidden size (64), so a [1, T, V] array is recognisable by shape
MAX_LEN = 48  # one cache shape for most tests keeps the number of compilations down


@pytest.fixture(scope="module")
def model():
    # 5 layers: one scanned block (slot axis 1 in the cache) and one tail layer (slot axis 0)
    return Qwen35MoeForCausalLM(C.tiny(vocab_size=VOCAB, num_hidden_layers=5), rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def peaked_model(model):
    """The same architecture with a 15x LM head: a few tokens carry most of the mass, so top-k/top-p bite."""
    m = nnx.clone(model)
    m.lm_head[...] = m.lm_head[...] * 15.0
    return m


_forward = jax.jit(lambda graphdef, state, ids_1xT: nnx.merge(graphdef, state)(ids_1xT), static_argnums=0)


def full_forward_logits(model, seq: list[int]) -> np.ndarray:
    """Full-forward (no cache) logits [len(seq), V] of `seq`, right-padded to MAX_LEN (causal: padding after a
    position cannot change it), so one compilation serves every length."""
    ids = np.zeros((1, MAX_LEN), np.int32)
    ids[0, :len(seq)] = seq
    return np.asarray(_forward(*nnx.split(model), jnp.asarray(ids)))[0, :len(seq)]


def full_forward_next_logits(model, seq: list[int]) -> np.ndarray:
    """Logits for the token after `seq`: a fresh forward of the whole prefix (the no-cache reference)."""
    return full_forward_logits(model, seq)[-1]


def scored_by_one_forward(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits that predicted each of `tokens` after `prompt`, from one causal forward of prompt + tokens."""
    return full_forward_logits(model, list(prompt) + list(tokens))[len(prompt) - 1:-1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def prompts_of(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB, size=n).tolist() for n in lengths]


def test_greedy_equals_argmax_of_full_forward_and_logprobs_match(model):
    prompts = prompts_of((3, 11, 15))
    samples = generate(model, prompts, max_new_tokens=8, temperature=0.0, num_slots=2, max_length=MAX_LEN)
    for prompt, sample in zip(prompts, samples):
        assert len(sample.tokens) == 8 and sample.finish_reason == "length"
        seq = list(prompt)
        for token, logprob in zip(sample.tokens, sample.logprobs):
            logits = full_forward_next_logits(model, seq)
            assert token == int(np.argmax(logits))
            np.testing.assert_allclose(logprob, log_softmax(logits)[token], atol=ATOL, rtol=0)
            seq.append(token)
        assert sample.history == seq


def test_sampled_logprobs_match_full_forward(model):
    """Temperature 1, no filtering: cached decoding scores every sampled token as the full forward does, and the
    sampling log-prob equals the policy log-prob."""
    prompts = prompts_of((5, 9), seed=1)
    samples = generate(model, prompts, max_new_tokens=10, seed=11, num_slots=2, max_length=MAX_LEN)
    for prompt, sample in zip(prompts, samples):
        logits = scored_by_one_forward(model, prompt, sample.tokens)
        for token, logprob, row in zip(sample.tokens, sample.logprobs, logits):
            np.testing.assert_allclose(logprob, log_softmax(row)[token], atol=ATOL, rtol=0)
        np.testing.assert_allclose(sample.sampling_logprobs, sample.logprobs, atol=1e-6, rtol=0)


def test_token_i_of_request_r_is_drawn_with_its_own_key(model):
    """The RNG contract: token i of request r (seed s) is categorical(fold_in(fold_in(PRNGKey(s), r), i), logits),
    whatever the slot or the step at which it was drawn."""
    prompts = prompts_of((6, 4, 9), seed=10)
    samples = generate(model, prompts, max_new_tokens=12, seed=7, num_slots=2, max_length=MAX_LEN)
    for r, (prompt, sample) in enumerate(zip(prompts, samples)):
        logits = scored_by_one_forward(model, prompt, sample.tokens)
        for i, (token, row) in enumerate(zip(sample.tokens, logits)):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), r), i)
            assert token == int(jax.random.categorical(key, jnp.asarray(row)))


def _run(model, requests, *, num_slots, steps_per_sync=8, max_length=MAX_LEN):
    engine = Engine(model, num_slots=num_slots, max_length=max_length, steps_per_sync=steps_per_sync)
    for r in requests:
        engine.submit(r)
    return engine.run(), engine


def test_request_is_independent_of_slots_neighbours_and_order(model):
    prompts = prompts_of((4, 13, 7, 20, 9, 2), seed=2)

    def request(i):
        return Request(request_id=100 + i, prompt=prompts[i], max_new_tokens=6 + 2 * i, seed=5)

    alone = {}
    for i in (0, 1, 2):
        alone.update(_run(model, [request(i)], num_slots=1)[0])
    together, _ = _run(model, [request(i) for i in range(6)], num_slots=2)
    shuffled, _ = _run(model, [request(i) for i in (5, 2, 3, 0, 4, 1)], num_slots=4)
    for rid, ref in alone.items():
        for other in (together[rid], shuffled[rid]):
            assert other.tokens == ref.tokens
            np.testing.assert_allclose(other.logprobs, ref.logprobs, atol=ATOL, rtol=0)
    for rid in together:
        assert shuffled[rid].tokens == together[rid].tokens
    # the same through the public API: request ids travel with the prompts
    via_generate = generate(model, [prompts[2], prompts[0]], max_new_tokens=10, seed=5, num_slots=2,
                            max_length=MAX_LEN, request_ids=[102, 100])
    assert via_generate[0].tokens == alone[102].tokens and via_generate[1].tokens[:6] == alone[100].tokens
    # control: the test can fail, another request id (or seed) draws other tokens
    moved, _ = _run(model, [Request(request_id=999, prompt=prompts[1], max_new_tokens=8, seed=5)], num_slots=1)
    assert moved[999].tokens != alone[101].tokens


def test_stop_tokens_budgets_and_finish_reasons(model):
    prompt = prompts_of((10,), seed=3)[0]
    free = generate(model, [prompt], max_new_tokens=12, temperature=0.0, max_length=MAX_LEN)[0]
    assert free.finish_reason == "length" and len(free.tokens) == 12
    stop = free.tokens[4]
    first = free.tokens.index(stop)
    stopped = generate(model, [prompt], max_new_tokens=12, temperature=0.0, stop_token_ids=(VOCAB - 1, stop),
                       max_length=MAX_LEN)[0]
    assert stopped.tokens == free.tokens[:first + 1] and stopped.finish_reason == "stop"
    at_once = generate(model, [prompt], max_new_tokens=12, temperature=0.0, stop_token_ids=(free.tokens[0],),
                       max_length=MAX_LEN)[0]
    assert at_once.tokens == free.tokens[:1] and at_once.finish_reason == "stop"
    # requests that all end at their first token, through one slot: the engine keeps admitting
    firsts, _ = _run(model, [Request(i, prompt, max_new_tokens=1, temperature=0.0) for i in range(3)], num_slots=1)
    assert [firsts[i].tokens for i in range(3)] == [free.tokens[:1]] * 3
    budget = generate(model, [prompt], max_new_tokens=5, temperature=0.0, max_length=MAX_LEN)[0]
    assert budget.tokens == free.tokens[:5] and budget.finish_reason == "length"
    one = generate(model, [prompt], max_new_tokens=1, temperature=0.0, max_length=MAX_LEN)[0]
    assert one.tokens == free.tokens[:1] and one.finish_reason == "length"
    # max_length caps prompt + generated: 30 + 18 = MAX_LEN
    long_prompt = prompts_of((30,), seed=3)[0]
    capped = generate(model, [long_prompt], max_new_tokens=25, temperature=0.0, max_length=MAX_LEN)[0]
    assert len(capped.tokens) == MAX_LEN - 30 and capped.finish_reason == "length"
    with pytest.raises(ValueError, match="leaves no room"):
        generate(model, [prompt], max_new_tokens=3, max_length=10)


def test_mixed_budgets_and_stops_in_one_batch(model):
    """Per-request budgets and stop ids inside one decode batch, with slots finishing at different steps."""
    prompts = prompts_of((6, 6, 6, 6), seed=4)
    refs = generate(model, prompts, max_new_tokens=10, temperature=0.0, max_length=MAX_LEN, num_slots=2)
    requests = [Request(i, prompts[i], max_new_tokens=3 + 2 * i, temperature=0.0,
                        stop_token_ids=(refs[i].tokens[2],) if i % 2 else ()) for i in range(4)]
    results, _ = _run(model, requests, num_slots=2)
    for i in range(4):
        ref = refs[i].tokens
        if i % 2:
            cut = ref.index(ref[2]) + 1
            assert results[i].tokens == ref[:cut] and results[i].finish_reason == "stop"
        else:
            assert results[i].tokens == ref[:3 + 2 * i] and results[i].finish_reason == "length"


def nucleus(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Naive reference set: the k most likely tokens, then the shortest prefix whose mass reaches p."""
    order = np.argsort(-logits)
    allowed = order[:top_k] if top_k else order
    probs = np.exp(log_softmax(logits[allowed]))
    return allowed[:int(np.sum(np.cumsum(probs) - probs < top_p))]


TEMPERATURE = 1.3


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 0.5), (3, 0.7)])
def test_top_k_top_p_tokens_lie_in_the_allowed_set(peaked_model, top_k, top_p):
    prompts = prompts_of((5, 8, 3, 12), seed=5)
    samples = generate(peaked_model, prompts, max_new_tokens=10, temperature=TEMPERATURE, top_k=top_k, top_p=top_p,
                       seed=1, num_slots=4, max_length=MAX_LEN)
    for prompt, sample in zip(prompts, samples):
        logits = scored_by_one_forward(peaked_model, prompt, sample.tokens) / TEMPERATURE
        for token, row in zip(sample.tokens, logits):
            assert token in nucleus(row, top_k, top_p)


def test_unfiltered_sampling_leaves_those_sets(peaked_model):
    """Control for the test above: the same prompts and seed without filtering draw tokens outside the top 2 and
    outside the p = 0.5 nucleus, so a sampler that ignored top_k / top_p would fail it."""
    prompts = prompts_of((5, 8, 3, 12), seed=5)
    samples = generate(peaked_model, prompts, max_new_tokens=10, temperature=TEMPERATURE, seed=1, num_slots=4,
                       max_length=MAX_LEN)
    outside_top2 = outside_nucleus = 0
    for prompt, sample in zip(prompts, samples):
        logits = scored_by_one_forward(peaked_model, prompt, sample.tokens) / TEMPERATURE
        for token, row in zip(sample.tokens, logits):
            outside_top2 += token not in nucleus(row, 2, 1.0)
            outside_nucleus += token not in nucleus(row, 0, 0.5)
    assert outside_top2 > 0 and outside_nucleus > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuation_with_kept_cache_equals_reprefill_and_full_forward(model, temperature):
    """Multi-turn: generate a turn, append observation tokens, generate the next turn."""
    prompt, observation = prompts_of((9, 5), seed=6)
    common = dict(temperature=temperature, seed=2)
    outcomes = {}
    for keep in (True, False):
        engine = Engine(model, num_slots=2, max_length=MAX_LEN)
        engine.submit(Request(1, prompt, max_new_tokens=6, keep_cache=keep, **common))
        engine.submit(Request(2, prompts_of((7,), seed=9)[0], max_new_tokens=9, **common))  # a neighbour
        engine.run()
        engine.submit(Request(3, observation, max_new_tokens=7, continue_from=1, **common))
        engine.run()
        outcomes[keep] = (engine.results[1], engine.results[3], engine.stats()["prefill_tokens"])
    (turn1, turn2, kept_prefill), (turn1_b, turn2_b, reprefill) = outcomes[True], outcomes[False]
    assert turn1.tokens == turn1_b.tokens and turn2.tokens == turn2_b.tokens
    np.testing.assert_allclose(turn2.logprobs, turn2_b.logprobs, atol=ATOL, rtol=0)
    assert turn2.history == prompt + turn1.tokens + observation + turn2.tokens
    assert reprefill - kept_prefill == len(prompt) + len(turn1.tokens) - 1  # history not recomputed
    logits = scored_by_one_forward(model, prompt + turn1.tokens + observation, turn2.tokens)
    for token, logprob, row in zip(turn2.tokens, turn2.logprobs, logits):
        if temperature == 0.0:
            assert token == int(np.argmax(row))
        np.testing.assert_allclose(logprob, log_softmax(row)[token], atol=ATOL, rtol=0)


def test_parked_slot_is_not_reused_and_release_frees_it(model):
    prompts = prompts_of((5, 6, 7), seed=7)
    engine = Engine(model, num_slots=2, max_length=MAX_LEN)
    engine.submit(Request(0, prompts[0], max_new_tokens=2, keep_cache=True, temperature=0.0))
    engine.run()
    engine.submit(Request(1, prompts[1], max_new_tokens=3, temperature=0.0))
    engine.submit(Request(2, prompts[2], max_new_tokens=3, temperature=0.0))
    engine.run()  # both run through the one free slot, one after the other
    engine.submit(Request(3, [1, 2], max_new_tokens=4, continue_from=0, temperature=0.0))
    engine.run()
    direct = generate(model, [prompts[0] + engine.results[0].tokens + [1, 2]], max_new_tokens=4, temperature=0.0,
                      max_length=MAX_LEN, num_slots=2)[0]
    assert engine.results[3].tokens == direct.tokens
    engine.submit(Request(4, [3], max_new_tokens=2, continue_from=1))  # not kept: re-prefilled
    engine.run()
    assert len(engine.results[4].tokens) == 2
    engine.submit(Request(5, [3], max_new_tokens=2, continue_from=3, keep_cache=True))
    engine.run()
    assert 5 in engine.parked
    engine.release(5)
    assert not engine.parked
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(Request(3, [1], max_new_tokens=1))
    assert engine.forget(3).tokens == direct.tokens and 3 not in engine.results
    with pytest.raises(ValueError, match="not a finished"):
        engine.submit(Request(6, [1], max_new_tokens=1, continue_from=3))


def test_continuous_batching_refills_slots_and_matches_static_batch(model):
    prompts = prompts_of((4,) * 8, seed=8)
    budgets = [4, 12, 4, 12, 4, 12, 4, 12]
    requests = [Request(i, prompts[i], max_new_tokens=budgets[i], seed=1) for i in range(8)]
    cont, cont_engine = _run(model, requests, num_slots=2)
    static_engine = Engine(model, num_slots=2, max_length=MAX_LEN, refill=False)
    for r in requests:
        static_engine.submit(r)
    static = static_engine.run()
    for i in range(8):
        assert len(cont[i].tokens) == budgets[i]
        assert cont[i].tokens == static[i].tokens
    c, s = cont_engine.stats(), static_engine.stats()
    assert c["generated_tokens"] == s["generated_tokens"] == sum(budgets)
    # static: each pair waits for its 12-token member: 11 decode steps after the prefill, two 8-step chunks
    assert s["decode_steps"] == 4 * 16 and c["decode_steps"] < s["decode_steps"]
    assert c["slot_occupancy"] > s["slot_occupancy"]


def test_weights_update_between_chunks_is_used_and_recorded(model):
    """Tokens after `update_weights` come from the new weights (greedy = argmax of the new model's forward, log-probs
    its log-softmax) and carry the new policy version; tokens before keep the old one."""
    prompt = prompts_of((7,), seed=11)[0]
    new_model = nnx.clone(model)
    new_model.lm_head[...] = new_model.lm_head[...][:, ::-1] * 3.0  # other argmax, other log-probs
    engine = Engine(model, num_slots=2, max_length=MAX_LEN, steps_per_sync=8)
    engine.submit(Request(0, prompt, max_new_tokens=20, temperature=0.0))
    assert engine.step()  # prefill (1 token) + one 8-step chunk
    engine.update_weights(new_model, version=5)
    sample = engine.run()[0]
    assert sample.policy_versions == [0] * 9 + [5] * 11 and sample.policy_version == 0
    old = scored_by_one_forward(model, prompt, sample.tokens)
    new = scored_by_one_forward(new_model, prompt, sample.tokens)
    assert any(int(np.argmax(o)) != int(np.argmax(n)) for o, n in zip(old[9:], new[9:]))
    for i, token in enumerate(sample.tokens):
        logits = old[i] if i < 9 else new[i]
        assert token == int(np.argmax(logits))
        np.testing.assert_allclose(sample.logprobs[i], log_softmax(logits)[token], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="same structure"):
        engine.update_weights(Qwen35MoeForCausalLM(C.tiny(vocab_size=VOCAB, num_hidden_layers=4),
                                                   rngs=nnx.Rngs(0)))


def test_prefill_never_builds_logits_for_every_prompt_position(model):
    """The prefill keeps only the last real position's logits: no [1, T, V] array in its compiled program (a
    16k-token prompt with the real 248k vocabulary would make that 16 GB)."""
    from mercury_jax.rollout.sampler import Sampler

    sampler = Sampler(model, num_slots=2, max_length=MAX_LEN)
    state = sampler.init_state()
    row = sampler._take_row(state["cache"], jnp.int32(0))
    request = {"reset": jnp.asarray(True), "limit": jnp.int32(4), "request_id": jnp.int32(0), "seed": jnp.int32(0),
               "temperature": jnp.float32(1.0), "top_k": jnp.int32(0), "top_p": jnp.float32(1.0),
               "stop_ids": jnp.full((8,), -1, jnp.int32)}
    ids = jnp.zeros((1, 32), jnp.int32)
    params = sampler._weights[0]
    text = sampler._prefill_row.lower(params, row, ids, jnp.int32(20), request).as_text()
    assert f"tensor<1x32x{VOCAB}xf32>" not in text
    assert f"tensor<1x{VOCAB}xf32>" in text  # control: the last position's logits are there
    forward = jax.jit(lambda p, i: nnx.merge(sampler.graphdef, p)(i)).lower(params, ids).as_text()
    assert f"tensor<1x32x{VOCAB}xf32>" in forward  # control: the pattern finds full logits where they exist


def test_a_long_prefill_runs_in_chunks_and_equals_one_call(model):
    """A run longer than `prefill_chunk(max_length)` is fed in chunks (what keeps a 131,072-token cache's prefill
    scores small): the first sampled token, its log-prob and the next decode steps equal the one-call prefill's
    (fp32; the chunks' GDN state and attention over the cache are the same sums, rtol 1e-5)."""
    from mercury_jax.rollout.sampler import PREFILL_SCORES, Sampler, TokenSampling, prefill_chunk

    assert prefill_chunk(24_576) == 16_384 and prefill_chunk(131_072) == 4_096  # the released and long contexts
    tokens = list(np.random.default_rng(0).integers(1, VOCAB, 41))
    sampling = TokenSampling(request_id=3, seed=1, temperature=1.0)
    outputs = []
    for scores in (PREFILL_SCORES, 16 * MAX_LEN):  # one call; chunks of 16 (41 = 16 + 16 + 9)
        calls = []
        sampler = Sampler(model, num_slots=2, max_length=MAX_LEN, prefill_scores=scores)
        real = sampler._prefill_row
        sampler._prefill_row = lambda *a, real=real, calls=calls: calls.append(a[2].shape[1]) or real(*a)
        state, first, _ = sampler.prefill(sampler.init_state(), 1, tokens, sampling, reset=True, limit=5)
        state, decoded, _ = sampler.decode(state, 4)
        outputs.append((jax.device_get(first), jax.device_get(decoded), calls))
    (first_1, decoded_1, calls_1), (first_c, decoded_c, calls_c) = outputs
    assert calls_1 == [MAX_LEN] and calls_c == [16, 16, 16]  # 41 tokens: one bucket of 48; 16 + 16 + 9 (in 16)
    assert int(first_c[0]) == int(first_1[0])
    np.testing.assert_allclose(float(first_c[1]), float(first_1[1]), rtol=1e-5)
    np.testing.assert_array_equal(decoded_c["token"], decoded_1["token"])
    np.testing.assert_allclose(decoded_c["logprob"], decoded_1["logprob"], rtol=1e-5, atol=1e-6)
