"""Environment failures in rollouts: the records kept when an episode's environment fails, and the filter the
trainers apply so that no such episode is trained on.

    kept, dropped = trainable(trajectories)     # the trajectories whose `env_failure` is None; how many were not
    runner.failures, worker.failures            # `EpisodeFailure` records, oldest first (the latest few hundred)
    runner.stats()["env_failures"]              # episodes whose environment failed so far (also worker.stats())

Stages of an `EpisodeFailure`:
- "open": building the world, connecting to the MCP server (initialize) or listing its tools failed or timed out.
  There is no trajectory to learn from: `EpisodeRunner.run` returns a placeholder in the task's place (no tokens,
  reward 0, `env_failure` set) so results stay aligned with the tasks; `RolloutWorker` queues nothing.
- "grade": grading raised or timed out, a rubric judge that gives no verdict included (`envs.judge.JudgeError`: its
  endpoint failed or replied without YES/NO; a guessed verdict would move the reward for the endpoint's fault). Same
  handling; the placeholder holds the episode's tokens.
- "tool": a tool call timed out or the server's connection was lost (the observation's `failure`). The episode
  went on (later calls to a dead server are not attempted) and its trajectory is delivered with `env_failure` set.
- "close": closing the environment failed after grading. The trajectory is delivered unmarked (it was graded).
A bug in the task itself (an unknown world, a prompt longer than the budget) is not an environment failure: it
raises as before.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mercury_jax.rollout.trajectory import Trajectory

STAGES = ("open", "tool", "grade", "close")


@dataclasses.dataclass(frozen=True)
class EpisodeFailure:
    """One environment failure: which task and episode, at which stage, and the error text."""
    task_id: str
    episode_id: int
    stage: str
    error: str


class EnvironmentFailure(RuntimeError):
    """An episode's environment failed to open or to grade, so the episode has no trainable trajectory.
    `failure`: the record; `trajectory`: the placeholder (`env_failure` set, reward 0) that stands in its place."""

    def __init__(self, failure: EpisodeFailure, trajectory: Trajectory):
        super().__init__(f"task {failure.task_id} (episode {failure.episode_id}): the environment failed at "
                         f"{failure.stage}: {failure.error}")
        self.failure, self.trajectory = failure, trajectory


def trainable(trajectories: Iterable[Trajectory]) -> tuple[list[Trajectory], int]:
    """(the trajectories no environment failure touched, in order; how many others were dropped)."""
    kept, dropped = [], 0
    for trajectory in trajectories:
        if trajectory.env_failure is None:
            kept.append(trajectory)
        else:
            dropped += 1
    return kept, dropped


def failure_placeholder(task_id: str, reason: str, **recorded) -> Trajectory:
    """The trajectory that stands for an episode without one: no tokens (or those `recorded` before the failure),
    reward 0, `env_failure` = `reason`."""
    empty = {"tokens": [], "action_mask": [], "rollout_logprobs": [], "policy_versions": [], "prompt_length": 0}
    return Trajectory(task_id=task_id, **{**empty, **recorded}, reward=0.0, env_failure=reason)
