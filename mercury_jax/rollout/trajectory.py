"""The trajectory: one episode as one token sequence, the unit both pipelines learn from (docs/ALGORITHMS.md).

`tokens` = prompt, then alternating assistant turns (sampled) and observations (inserted), exactly as the
sampler saw them (token-in, token-out). `action_mask[t] = 1` exactly for sampled tokens (assistant text, tool-call
text, the `<|im_end|>` closing an assistant turn). `rollout_logprobs[t]` is the behaviour policy's log-prob of
sampled token t (0 elsewhere) and `policy_versions[t]` the weights version that sampled it (-1 elsewhere).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FINISH_REASONS = ("answered", "turn_budget", "token_budget", "degenerate")


@dataclasses.dataclass
class Trajectory:
    task_id: str
    tokens: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    policy_versions: list[int]
    prompt_length: int
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # [start, end) of assistant turns
    tool_calls: list[dict] = dataclasses.field(default_factory=list)    # {"turn", "name", "arguments"}
    tool_results: list[dict] = dataclasses.field(default_factory=list)  # {"turn", "name", "text", "is_error"}
    format_errors: list[str] = dataclasses.field(default_factory=list)
    assistant_texts: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str = "answered"
    reward: float = 0.0
    reward_parts: dict[str, Any] = dataclasses.field(default_factory=dict)  # effects_fraction, multiplier, ...
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # why the environment, not the policy, spoiled this episode (a tool timeout, a dead MCP server, a failed open
    # or grade); None when clean. Such trajectories are delivered for logging but not trained on:
    # `rollout.failures.trainable` drops them.
    env_failure: str | None = None
    episode_id: int = -1  # the run's episode number (its request ids derive from it); -1 where nobody set it

    def __post_init__(self):
        n = len(self.tokens)
        for name in ("action_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.task_id}: {name} has {len(getattr(self, name))} entries for "
                                 f"{n} tokens")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")

    @property
    def num_action_tokens(self) -> int:
        return int(sum(self.action_mask))

    @property
    def policy_version(self) -> int:
        """The oldest weights version that sampled any token (what staleness is measured against)."""
        versions = [v for v, m in zip(self.policy_versions, self.action_mask) if m]
        return min(versions) if versions else -1

    @property
    def truncated(self) -> bool:
        return self.finish_reason in ("token_budget", "degenerate")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Trajectory:
        data = dict(data)
        data["turn_spans"] = [tuple(s) for s in data.get("turn_spans", [])]
        return cls(**data)


def padded_length(trajectories: list[Trajectory], limit: int) -> int:
    """The one padding rule of the learner batches: the longest trajectory rounded up to a bucket (128 tokens for
    budgets up to 4,096, else 2,048), at most the budget rounded up. Each bucket is one compiled shape of the
    learner functions, so a run compiles a few and then pays only for the tokens its batches hold."""
    bucket = 128 if limit <= 4096 else 2048
    ceiling = -(-limit // bucket) * bucket
    return min(-(-max(len(t.tokens) for t in trajectories) // bucket) * bucket, ceiling)


def batch_trajectories(trajectories: list[Trajectory], length: int, *, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pad trajectories into [B, length] arrays.

    tokens (int32), action_mask (float32), rollout_logprobs (float32), rewards (float32, the trajectory reward on
    its last action token), lengths (int32). A trajectory longer than `length` is an error (the budget should
    have stopped it).
    """
    B = len(trajectories)
    batch = {
        "tokens": np.full((B, length), pad_id, np.int32),
        "action_mask": np.zeros((B, length), np.float32),
        "rollout_logprobs": np.zeros((B, length), np.float32),
        "rewards": np.zeros((B, length), np.float32),
        "lengths": np.zeros((B,), np.int32),
    }
    for b, traj in enumerate(trajectories):
        n = len(traj.tokens)
        if n > length:
            raise ValueError(f"trajectory {traj.task_id} has {n} tokens, more than the batch length {length}; "
                             f"raise the batch length or lower max_total_tokens")
        batch["tokens"][b, :n] = traj.tokens
        batch["action_mask"][b, :n] = traj.action_mask
        batch["rollout_logprobs"][b, :n] = traj.rollout_logprobs
        batch["lengths"][b] = n
        actions = np.flatnonzero(np.asarray(traj.action_mask))
        if len(actions):
            batch["rewards"][b, actions[-1]] = traj.reward
    return batch
