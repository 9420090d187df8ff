"""The learner batch of G groups of K episodes (pivot GRPO's states, the group baseline's tasks): one row per
episode, the group advantage on its action tokens, dropped groups masked out."""
from __future__ import annotations

import numpy as np

from mercury_jax.rollout.trajectory import Trajectory, batch_trajectories


def group_batch(trajectories: list[Trajectory], advantages_GxK: np.ndarray, keep_G: np.ndarray, length: int, *,
                pad_id: int) -> dict[str, np.ndarray]:
    """`batch_trajectories` of G groups of K one-turn episodes (row g*K + k), with the group advantage A[g, k] on
    the action tokens and the action mask emptied in dropped groups: tokens, action_mask, rollout_logprobs,
    advantages."""
    batch = batch_trajectories(trajectories, length, pad_id=pad_id)
    keep_rows = np.repeat(np.asarray(keep_G, np.float32), advantages_GxK.shape[1])
    batch["action_mask"] *= keep_rows[:, None]
    batch["advantages"] = batch["action_mask"] * np.asarray(advantages_GxK, np.float32).reshape(-1)[:, None]
    del batch["rewards"], batch["lengths"]
    return batch
