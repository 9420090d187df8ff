"""`batch_trajectories`: the learner's [B, length] layout of a batch of episodes, token for token against arrays
written out by hand (action mask, rollout log-probs, the reward on the last *action* token, lengths, padding).

The three trajectories cover the cases a layout bug hides in: a multi-turn episode that ends on an action, one that
ends on an observation (its last token is not an action, so "reward on the last token" and "reward on the last
action token" differ), and one without any action token. Log-probs are powers of two: exact in float32, so every
comparison is exact.
"""
from __future__ import annotations

import numpy as np
import pytest

from mercury_jax.rollout.trajectory import Trajectory, batch_trajectories

PAD = 99  # not 0, so padding is told apart from a real token


def _trajectory(task_id, segments, reward, finish_reason="answered"):
    """Trajectory from (kind, tokens, logprobs) segments; kind "prompt" / "obs" inserted, "act" sampled."""
    tokens, mask, logprobs, spans = [], [], [], []
    for kind, seg_tokens, seg_logprobs in segments:
        if kind == "act":
            spans.append((len(tokens), len(tokens) + len(seg_tokens)))
        tokens += seg_tokens
        mask += [int(kind == "act")] * len(seg_tokens)
        logprobs += seg_logprobs if kind == "act" else [0.0] * len(seg_tokens)
    return Trajectory(task_id=task_id, tokens=tokens, action_mask=mask, rollout_logprobs=logprobs,
                      policy_versions=[3 if m else -1 for m in mask], prompt_length=len(segments[0][1]),
                      turn_spans=spans, finish_reason=finish_reason, reward=reward)


def three_trajectories():
    two_turns = _trajectory("two-turns", [
        ("prompt", [11, 12, 13], None),
        ("act", [21, 22, 23], [-0.5, -0.25, -0.125]),  # 23: the <|im_end|> closing the turn is sampled too
        ("obs", [31, 32], None),
        ("act", [41, 42], [-1.0, -2.0]),
    ], reward=0.75)
    ends_on_observation = _trajectory("ends-on-observation", [
        ("prompt", [11, 12], None),
        ("act", [51, 52], [-0.375, -0.0625]),
        ("obs", [61, 62, 63], None),
    ], reward=-1.0, finish_reason="turn_budget")
    no_action = _trajectory("no-action", [("prompt", [11], None)], reward=0.5, finish_reason="token_budget")
    return [two_turns, ends_on_observation, no_action]


def test_batch_layout_token_for_token():
    batch = batch_trajectories(three_trajectories(), 12, pad_id=PAD)
    assert set(batch) == {"tokens", "action_mask", "rollout_logprobs", "rewards", "lengths"}
    assert {k: v.dtype for k, v in batch.items()} == {
        "tokens": np.int32, "action_mask": np.float32, "rollout_logprobs": np.float32, "rewards": np.float32,
        "lengths": np.int32}
    P = PAD
    np.testing.assert_array_equal(batch["tokens"], [
        [11, 12, 13, 21, 22, 23, 31, 32, 41, 42, P, P],
        [11, 12, 51, 52, 61, 62, 63, P, P, P, P, P],
        [11, P, P, P, P, P, P, P, P, P, P, P]])
    np.testing.assert_array_equal(batch["action_mask"], [
        [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["rollout_logprobs"], [
        [0, 0, 0, -0.5, -0.25, -0.125, 0, 0, -1.0, -2.0, 0, 0],
        [0, 0, -0.375, -0.0625, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    # the reward sits on the last action token: row 0 its final <|im_end|> (index 9), row 1 the end of its only
    # turn (index 3, before the observation that closes the row); a row without action tokens has no token to
    # credit (as `rl.advantages.place_terminal_reward`)
    np.testing.assert_array_equal(batch["rewards"], [
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0.75, 0, 0],
        [0, 0, 0, -1.0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["lengths"], [10, 7, 1])


def test_row_exactly_the_batch_length_fits_and_a_longer_one_is_an_error():
    two_turns = three_trajectories()[0]
    batch = batch_trajectories([two_turns], 10, pad_id=PAD)
    np.testing.assert_array_equal(batch["tokens"][0], two_turns.tokens)
    np.testing.assert_array_equal(batch["action_mask"][0], two_turns.action_mask)
    np.testing.assert_array_equal(batch["rewards"][0], [0] * 9 + [0.75])
    with pytest.raises(ValueError, match=r"two-turns has 10 tokens, more than the batch length 9; raise the batch "
                                         r"length or lower max_total_tokens"):
        batch_trajectories([two_turns], 9)


def test_trajectory_rejects_misaligned_per_token_lists():
    with pytest.raises(ValueError, match="action_mask has 2 entries for 3 tokens"):
        Trajectory(task_id="t", tokens=[1, 2, 3], action_mask=[0, 1], rollout_logprobs=[0, 0, 0],
                   policy_versions=[-1, -1, -1], prompt_length=1)
