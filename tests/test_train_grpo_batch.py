"""`group_batch`: the pivot-GRPO learner's [G*K, length] layout (one-turn episodes through `batch_trajectories`),
token for token against arrays written out by hand (prompt then continuation per row, action mask on the
continuation of kept groups only, rollout log-probs, the group advantage broadcast over the continuation's
tokens, padding).

Values are powers of two (exact in float32), so every comparison is exact.
"""
from __future__ import annotations

import numpy as np
import pytest

from mercury_jax.rollout.trajectory import Trajectory
from mercury_jax.train.group_batch import group_batch

PAD = 99  # not 0, so padding is told apart from a real token


def two_groups_of_two():
    """G = 2 states, K = 2 continuations each; prompts of different lengths, continuations of 1 to 4 tokens."""
    rows = [([1, 2, 3], [10, 11, 12], [-0.5, -0.25, -0.125]), ([1, 2, 3], [13], [-1.0]),
            ([4, 5], [14, 15], [-2.0, -0.75]), ([4, 5], [16, 17, 18, 19], [-0.5] * 4)]
    trajectories = [Trajectory("t", p + c, [0] * len(p) + [1] * len(c), [0.0] * len(p) + lp,
                               [-1] * len(p) + [0] * len(c), len(p), turn_spans=[(len(p), len(p) + len(c))])
                    for p, c, lp in rows]
    advantages_GxK = np.array([[0.5, -0.5], [0.25, -0.25]], np.float32)
    return trajectories, advantages_GxK


P = PAD
TOKENS = [[1, 2, 3, 10, 11, 12, P, P],
          [1, 2, 3, 13, P, P, P, P],
          [4, 5, 14, 15, P, P, P, P],
          [4, 5, 16, 17, 18, 19, P, P]]
ROLLOUT_LOGPROBS = [[0, 0, 0, -0.5, -0.25, -0.125, 0, 0],
                    [0, 0, 0, -1.0, 0, 0, 0, 0],
                    [0, 0, -2.0, -0.75, 0, 0, 0, 0],
                    [0, 0, -0.5, -0.5, -0.5, -0.5, 0, 0]]


def test_layout_of_kept_groups_token_for_token():
    trajectories, advantages_GxK = two_groups_of_two()
    batch = group_batch(trajectories, advantages_GxK, np.array([True, True]), 8, pad_id=PAD)
    assert {k: v.dtype for k, v in batch.items()} == {
        "tokens": np.int32, "action_mask": np.float32, "rollout_logprobs": np.float32, "advantages": np.float32}
    np.testing.assert_array_equal(batch["tokens"], TOKENS)
    np.testing.assert_array_equal(batch["action_mask"], [[0, 0, 0, 1, 1, 1, 0, 0],
                                                         [0, 0, 0, 1, 0, 0, 0, 0],
                                                         [0, 0, 1, 1, 0, 0, 0, 0],
                                                         [0, 0, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["rollout_logprobs"], ROLLOUT_LOGPROBS)
    np.testing.assert_array_equal(batch["advantages"], [[0, 0, 0, 0.5, 0.5, 0.5, 0, 0],
                                                        [0, 0, 0, -0.5, 0, 0, 0, 0],
                                                        [0, 0, 0.25, 0.25, 0, 0, 0, 0],
                                                        [0, 0, -0.25, -0.25, -0.25, -0.25, 0, 0]])


def test_a_dropped_group_keeps_its_tokens_but_trains_on_nothing():
    """`filter_zero_variance` drops group 1: its rows stay in the batch (fixed shapes) with an empty action mask and
    zero advantages; group 0 is laid out exactly as when every group is kept."""
    trajectories, advantages_GxK = two_groups_of_two()
    batch = group_batch(trajectories, advantages_GxK, np.array([True, False]), 8, pad_id=PAD)
    np.testing.assert_array_equal(batch["tokens"], TOKENS)
    np.testing.assert_array_equal(batch["action_mask"], [[0, 0, 0, 1, 1, 1, 0, 0],
                                                         [0, 0, 0, 1, 0, 0, 0, 0],
                                                         [0] * 8,
                                                         [0] * 8])
    np.testing.assert_array_equal(batch["rollout_logprobs"], ROLLOUT_LOGPROBS)
    np.testing.assert_array_equal(batch["advantages"], [[0, 0, 0, 0.5, 0.5, 0.5, 0, 0],
                                                        [0, 0, 0, -0.5, 0, 0, 0, 0],
                                                        [0] * 8,
                                                        [0] * 8])


def test_row_exactly_the_batch_length_fits_and_a_longer_one_is_an_error():
    trajectories, advantages_GxK = two_groups_of_two()
    batch = group_batch(trajectories, advantages_GxK, np.array([True, True]), 6, pad_id=PAD)
    np.testing.assert_array_equal(batch["tokens"][3], [4, 5, 16, 17, 18, 19])  # 2 + 4 tokens: no padding
    with pytest.raises(ValueError, match="has 6 tokens, more than the batch length 5"):
        group_batch(trajectories, advantages_GxK, np.array([True, True]), 5, pad_id=PAD)
