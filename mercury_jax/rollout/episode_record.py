"""What an episode in progress has produced: its token sequence with the per-token columns the learners read, the
turns' texts, the tool calls and their results, the chat transcript a grader reads, and the timings. The episode
runner appends to it turn by turn and turns it into a `Trajectory` at the end."""
from __future__ import annotations

import dataclasses

from mercury_jax.rollout.engine import Sample
from mercury_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass
class EpisodeRecord:
    prompt: list[int]
    transcript: list[dict]                     # the prompt's chat messages, then each turn and tool result
    tokens: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[int] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    calls: list[dict] = dataclasses.field(default_factory=list)
    results: list[dict] = dataclasses.field(default_factory=list)
    format_errors: list[str] = dataclasses.field(default_factory=list)
    timings: dict = dataclasses.field(default_factory=lambda: {"generate_s": 0.0, "tools_s": 0.0})
    finish: str | None = None
    final_text: str = ""

    def __post_init__(self):
        self.add_inserted(self.prompt)

    def add_inserted(self, ids: list[int]) -> None:
        """Tokens the policy did not sample (the prompt, an observation): masked out, no log-prob, version -1."""
        self.tokens += ids
        self.action_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        self.policy_versions += [-1] * len(ids)

    def add_sampled(self, sample: Sample) -> None:
        """A turn's sampled tokens with the behaviour policy's log-probs and the weights version of each."""
        n = len(sample.tokens)
        self.spans.append((len(self.tokens), len(self.tokens) + n))
        self.tokens += sample.tokens
        self.action_mask += [1] * n
        self.rollout_logprobs += [float(x) for x in sample.logprobs]
        self.policy_versions += [int(v) for v in sample.policy_versions]

    def columns(self) -> dict:
        """The trajectory's fields recorded so far (also what a failure placeholder keeps)."""
        return {"tokens": self.tokens, "action_mask": self.action_mask, "rollout_logprobs": self.rollout_logprobs,
                "policy_versions": self.policy_versions, "prompt_length": len(self.prompt),
                "turn_spans": self.spans, "tool_calls": self.calls, "tool_results": self.results,
                "format_errors": self.format_errors, "assistant_texts": self.texts, "finish_reason": self.finish,
                "timings": self.timings}

    def trajectory(self, task_id: str, env_failure: str | None) -> Trajectory:
        return Trajectory(task_id=task_id, env_failure=env_failure, **self.columns())
