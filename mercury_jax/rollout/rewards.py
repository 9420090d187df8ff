"""Episode rewards: what `EpisodeRunner` pays a finished trajectory. A reward is any callable

    reward(task, trajectory, grade) -> (reward: float, parts: dict)

(`grade` is what the task's environment returned from `grade(final answer, transcript)`; `parts` are logged in
`trajectory.reward_parts`). Pipelines pass theirs to the runner; tests pass synthetic ones.

- `EffectsReward` (SAO, docs/ENVIRONMENTS.md section 2): effects_fraction x behaviour multiplier.
- `StopVerifierReward` (pivot GRPO, docs/ALGORITHMS.md pipeline 2): the stop verifier's verdict on the one turn a
  pivot state's episode samples; a turn cut off before its stop token, or holding ids the tokenizer cannot
  decode, is `malformed` whatever its text.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mercury_jax.envs import BehaviourConfig, behaviour_multiplier
from mercury_jax.envs.behaviour import states_answer
from mercury_jax.envs.browse.stop_verifier import STOP_RULES, verify_stop
from mercury_jax.rollout.decode import decode_known
from mercury_jax.rollout.trajectory import Trajectory

Reward = Callable[[Mapping, Trajectory, Mapping], tuple[float, dict]]
TRUNCATIONS = ("token_budget", "degenerate")  # finish reasons that cut a turn before its stop token


class EffectsReward:
    """reward = effects_fraction x behaviour_multiplier(texts, finish, answered turn, violations, format errors)."""

    def __init__(self, behaviour: BehaviourConfig = BehaviourConfig()):
        self.behaviour = behaviour

    def __call__(self, task: Mapping, trajectory: Trajectory, grade: Mapping) -> tuple[float, dict]:
        texts, finish = trajectory.assistant_texts, trajectory.finish_reason
        answered_turn = next((i for i, t in enumerate(texts) if states_answer(t)),
                             len(texts) - 1 if finish == "answered" else None)
        multiplier, parts = behaviour_multiplier(texts, finish_reason="truncated" if finish in TRUNCATIONS else finish,
                                                 answered_turn=answered_turn,
                                                 forbidden_violations=int(grade.get("forbidden_violations", 0)),
                                                 format_errors=len(trajectory.format_errors), config=self.behaviour)
        effects = float(grade["effects_fraction"])
        return effects * multiplier, {"effects_fraction": effects, "all_effects_pass": bool(grade["all_effects_pass"]),
                                      "multiplier": multiplier, **parts, "grade": grade}


class StopVerifierReward:
    """The stop verifier's reward for the last sampled turn of a pivot state's episode (the task is the state:
    its `task`, chat `prefix` and `tools`). Parts: the verdict (outcome, answer, ...) and `cut_off`."""

    def __init__(self, tokenizer, rules: Mapping[str, float] | None = None):
        self.tokenizer, self.rules = tokenizer, {**STOP_RULES, **(rules or {})}

    def __call__(self, task: Mapping, trajectory: Trajectory, grade: Mapping) -> tuple[float, dict]:
        start, end = trajectory.turn_spans[-1]
        text, unknown = decode_known(self.tokenizer, trajectory.tokens[start:end])
        verdict = verify_stop(task["task"], task["prefix"], text, tools=task["tools"], rules=self.rules)
        cut_off = trajectory.finish_reason in TRUNCATIONS
        if cut_off or unknown:
            verdict = {**verdict, "outcome": "malformed", "reward": self.rules["malformed"]}
        return float(verdict["reward"]), {**verdict, "cut_off": cut_off}


def plain(value: Any) -> Any:
    """`value` with tuples as lists and non-JSON leaves as strings (reward_parts must survive to_json)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
