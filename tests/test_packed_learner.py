"""Packed learner batches (train/packing.py `place_rows`, `pack_batch`; `sao.pack_rows`, `grpo.pack_rows`):
trajectories share rows first-fit decreasing by token count, the filled rows take the first micro-batches and an
empty micro-batch is skipped; every learner step on the packed batch equals the whole padded batch's step.

Reference: the padded batch (one trajectory per row) through the same step maker with micro_batches=1. Setting
and tolerances as test_microbatch.py (8-device CPU mesh data=2 x fsdp=2 x expert=2, `TokenMixture`, whose token
mixing stops at segment boundaries as the real model's attention and GDN do; tests/test_model_decode_packing.py
checks that for the real model): metrics and gradients to the float32 rounding bounds of tests/tolerances.py. The
packed program sums the same per-token terms in another order (rows regrouped, one micro-batch skipped), nothing else.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx
from test_microbatch import (
    GRPO,
    RTOL,
    SAO,
    B,
    M,
    T,
    TokenMixture,
    assert_same_step,
    capture_gradients,
    policy_batch,
    run,
)

from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.rl.aggregation import LOSS_AGG_MODES, aggregate
from mercury_jax.train.grpo_learner import make_grpo_step
from mercury_jax.train.packing import pack_batch, place_rows, rows_used
from mercury_jax.train.placement import batch_to_mesh
from mercury_jax.train.sao_learner import make_actor_step, make_advantage_fn, make_critic_step, relayout
from mercury_jax.train.state import TrainState


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "fsdp": 2, "expert": 2})


@pytest.fixture(scope="module")
def small_model(mesh):
    return shard_params(TokenMixture(nnx.Rngs(0)), mesh)


def lengths_of(batch) -> np.ndarray:
    return (batch["tokens"] != 0).sum(1)  # test rows hold nonzero tokens, then zeros


def short_rows(batch, keep: int = 7):
    """The batch with every row cut to its first `keep` tokens, so 16 rows pack into few (an empty micro-batch)."""
    return {k: np.where(np.arange(T) < keep, v, 0).astype(v.dtype) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------ placement
def test_a_long_trajectory_keeps_its_row_and_sixteen_short_ones_share_one():
    lengths = [1536] * 8 + [24576] + [1536] * 8
    row_of, offset_of = place_rows(lengths, 24576, rows=32, micro_batches=4)
    assert row_of[8] == 0 and offset_of[8] == 0
    shared = np.delete(np.arange(17), 8)
    assert set(row_of[shared]) == {4}  # the second-fullest row: micro-batch 0 (row 4 = 0 + 4 x 1)
    np.testing.assert_array_equal(np.sort(offset_of[shared]), np.arange(16) * 1536)


def test_filled_rows_take_the_first_micro_batches_fullest_first():
    lengths = [10, 9, 8, 7, 3, 2, 2, 1]
    row_of, offset_of = place_rows(lengths, 10, rows=8, micro_batches=2)
    fill = np.bincount(row_of, weights=lengths, minlength=8)
    # first-fit decreasing: {10}, {9, 1}, {8, 2}, {7, 3}, {2}; micro-batch 0 (rows 0, 2, 4, 6) takes the four
    # full rows, micro-batch 1 (rows 1, 3, 5, 7) the rest
    np.testing.assert_array_equal(fill, [10, 2, 10, 0, 10, 0, 10, 0])
    assert all(offset_of[i] + lengths[i] <= 10 for i in range(len(lengths)))


def test_too_long_or_too_many_sequences_are_named():
    with pytest.raises(ValueError, match="sequence 1 has 12 tokens, more than the row length 10"):
        place_rows([3, 12], 10, rows=4)
    with pytest.raises(ValueError, match="3 sequences need 3 rows of 10 tokens; only 2"):
        place_rows([8, 8, 8], 10, rows=2)


def test_pack_and_unpack_are_inverse_and_segments_are_numbered_per_row(small_model, mesh):
    batch = policy_batch(small_model, mesh, eps_low=0.2, eps_high=0.28)
    packed = pack_batch(batch, lengths_of(batch), M)
    assert rows_used(packed) < B and rows_used(batch) == B
    for key in ("tokens", "action_mask", "rollout_logprobs", "advantages"):
        np.testing.assert_array_equal(np.asarray(relayout(packed[key], packed["unpack_index"])), batch[key])
        np.testing.assert_array_equal(np.asarray(relayout(batch[key], packed["pack_index"])), packed[key])
    for row in packed["segment_ids"]:
        ids = row[row > 0]
        assert np.all(np.diff(ids) >= 0) and (len(ids) == 0 or ids[0] == 1) and np.all(row[len(ids):] == 0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_over_segments_equals_aggregation_over_rows(small_model, mesh, mode):
    batch = policy_batch(small_model, mesh, eps_low=0.2, eps_high=0.28)
    packed = pack_batch(batch, lengths_of(batch), M)
    per_token = np.random.default_rng(0).normal(size=(B, T)).astype(np.float32)
    want = np.asarray(aggregate(per_token, batch["action_mask"], mode))
    got = np.asarray(aggregate(np.asarray(relayout(per_token, packed["pack_index"])), packed["action_mask"], mode,
                               segment_ids=packed["segment_ids"]))
    # terms of both signs: the sums' rounding scales with the sum of magnitudes (tests/tolerances.py), 8-12 x |sum|
    magnitude = np.asarray(aggregate(np.abs(per_token), batch["action_mask"], mode))
    assert np.all(np.abs(got - want) <= RTOL * magnitude), (got, want, magnitude)


# ------------------------------------------------------------------------------------------------ steps
def packed_vs_padded(make_step, model, cfg, batch, mesh, field, **kwargs):
    packed = pack_batch(batch, lengths_of(batch), M)
    assert rows_used(packed) <= B - B // M  # the last micro-batch is empty and skipped
    whole = run(make_step, model, ml_collections.ConfigDict({**cfg, field: 1}), batch, mesh, **kwargs)
    micro = run(make_step, model, ml_collections.ConfigDict({**cfg, field: M}), packed, mesh, **kwargs)
    assert_same_step(whole, micro)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_sao_actor_step_equals_the_padded_batch(small_model, mesh, loss_agg):
    batch = short_rows(policy_batch(small_model, mesh, eps_low=SAO["eps_low"], eps_high=SAO["eps_high"]))
    packed_vs_padded(make_actor_step, small_model, dict(SAO, loss_agg=loss_agg), batch, mesh, "actor_micro_batches")


def test_packed_sao_critic_step_equals_the_padded_batch(small_model, mesh):
    rng = np.random.default_rng(2)
    batch = short_rows(policy_batch(small_model, mesh, eps_low=0.2, eps_high=0.28))
    mask = batch["action_mask"]
    batch = {"tokens": batch["tokens"], "action_mask": mask,
             "old_values": (rng.normal(0.0, 0.5, (B, T)) * mask).astype(np.float32),
             "returns": (rng.normal(1.0, 1.0, (B, T)) * mask).astype(np.float32)}
    packed_vs_padded(make_critic_step, small_model, dict(SAO, value_clip=0.2, loss_agg="token-mean"), batch, mesh,
                     "critic_micro_batches")


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_grpo_step_equals_the_padded_batch(small_model, mesh, loss_agg):
    batch = short_rows(policy_batch(small_model, mesh, eps_low=GRPO["eps"], eps_high=GRPO["eps_high"], seed=3,
                                    grpo=True))
    packed_vs_padded(make_grpo_step, small_model, dict(GRPO, loss_agg=loss_agg), batch, mesh, "micro_batches")


def test_packed_advantages_equal_the_padded_ones(small_model, mesh):
    """Values on packed rows, GAE on the trajectories: advantages, returns and values, moved back to the padded
    layout, equal the padded batch's (fp32, rtol 1e-6, atol 1e-6 as test_microbatch's value forward; observed
    bit-equal with XLA:CPU's default, AVX2 and SSE4.2 code)."""
    batch = short_rows(policy_batch(small_model, mesh, eps_low=0.2, eps_high=0.28))
    mask = batch["action_mask"]
    rewards = np.zeros_like(mask)
    last = np.where(mask.any(1), T - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
    rewards[np.arange(B), last] = np.random.default_rng(4).uniform(0, 1, B) * mask.any(1)
    padded = {"tokens": batch["tokens"], "action_mask": mask, "rewards": rewards}
    packed = pack_batch(padded, lengths_of(padded), M)
    state = TrainState.create(small_model, capture_gradients())
    cfg = ml_collections.ConfigDict(dict(alpha=0.05, gamma=1.0, lam_critic=1.0, whiten_advantages=True,
                                         critic_micro_batches=M))
    advantage_fn = make_advantage_fn(state.graphdef, cfg, mesh=mesh)
    want = jax.device_get(advantage_fn(state.params, state.frozen, batch_to_mesh(padded, mesh)))
    got = jax.device_get(advantage_fn(state.params, state.frozen, batch_to_mesh(packed, mesh)))
    for w, g in zip(want[:3], got[:3]):
        np.testing.assert_allclose(np.asarray(relayout(g, packed["unpack_index"])), w, rtol=1e-6, atol=1e-6)
    for key in want[3]:
        np.testing.assert_allclose(got[3][key], want[3][key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert np.abs(want[0]).sum() > 0


def test_the_step_skips_empty_micro_batches_by_a_branch(small_model, mesh):
    state = TrainState.create(small_model, capture_gradients())
    cfg = ml_collections.ConfigDict(dict(SAO, loss_agg="token-mean", actor_micro_batches=M))
    batch = policy_batch(small_model, mesh, eps_low=0.2, eps_high=0.28)
    step = make_actor_step(state.graphdef, state.tx, cfg)
    text = step.lower(state.params, state.frozen, state.opt_state, batch_to_mesh(batch, mesh)).as_text()
    assert "stablehlo.case" in text or "stablehlo.if" in text
