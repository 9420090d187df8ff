"""What a batch of episodes looked like, for the trainers' logs: the released run's reward table, the spread of
episode lengths, and how long the batch's episodes waited for its slowest one (the barrier a step that learns from
whole batches, or whole groups, pays)."""
from __future__ import annotations

import numpy as np

from mercury_jax.rollout.trajectory import Trajectory


def length_spread(trajectories: list[Trajectory]) -> dict:
    """The batch's spread of episode lengths (action tokens): a sync batch waits for its longest episode."""
    lengths = np.array([t.num_action_tokens for t in trajectories])
    return {"response_length_min": int(lengths.min()), "response_length_max": int(lengths.max())}


def trajectory_metrics(trajectories: list[Trajectory]) -> dict:
    """The released run's table for one batch: reward, all-effects pass, degenerate and truncation rates,
    mean raw response length (action tokens), plus format errors and staleness inputs."""
    reward = np.array([t.reward for t in trajectories])
    return {
        "reward": float(reward.mean()),
        "reward_std": float(reward.std()),
        "effects_fraction": float(np.mean([t.reward_parts.get("effects_fraction", 0.0) for t in trajectories])),
        "all_effects_pass": float(np.mean([bool(t.reward_parts.get("all_effects_pass")) for t in trajectories])),
        "degenerate_rate": float(np.mean([t.finish_reason == "degenerate" for t in trajectories])),
        "truncation_rate": float(np.mean([t.finish_reason in ("token_budget", "degenerate", "turn_budget")
                                          for t in trajectories])),
        "response_length": float(np.mean([t.num_action_tokens for t in trajectories])),
        "format_errors": float(np.mean([len(t.format_errors) for t in trajectories])),
        "tool_calls": float(np.mean([len(t.tool_calls) for t in trajectories])),
    }


def barrier_wait(trajectories: list[Trajectory], group_size: int = 1) -> dict:
    """`barrier_wait_s`: the slowest episode's wall time minus the mean episode's, i.e. how long the average
    episode's slot waits for the batch to finish (episodes that start together, as a sync batch's do). With
    `group_size` K > 1 (consecutive trajectories form a group) also `group_wait_s`, the same within each group,
    averaged: what a group barrier alone would cost."""
    seconds = np.array([t.timings.get("total_s", 0.0) for t in trajectories])
    waits = {"barrier_wait_s": float(seconds.max() - seconds.mean())}
    if group_size > 1 and len(seconds) % group_size == 0:
        groups = seconds.reshape(-1, group_size)
        waits["group_wait_s"] = float(np.mean(groups.max(axis=1) - groups.mean(axis=1)))
    return waits
