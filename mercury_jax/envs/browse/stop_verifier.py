"""Deterministic stop-verifier: the reward of one continuation (the next assistant turn) from a pivot state.

Rules, applied in this order to the continuation text (parsed with `mercury_jax.chat.parse_assistant`):
1. `malformed`: the turn has parse errors, or neither a tool call nor a `Final answer:` line, or both.
2. A tool call (searching on):
   - `over_search` when the evidence in the prefix is already sufficient;
   - `continue_insufficient` otherwise (gathering needed evidence is the right move).
3. An answer (`Final answer: X`):
   - `premature` when the evidence in the prefix is not sufficient (even if X happens to be right);
   - `ungrounded` when X does not occur in the page text observed in the prefix;
   - `wrong` when X is grounded but not the gold answer (normalized: case, punctuation, articles);
   - `correct_stop` otherwise.
The reward is `STOP_RULES[outcome]` (override any weight with `rules=`): only a correct, grounded stop on
sufficient evidence earns the full reward; over-search, premature, ungrounded, wrong and malformed earn nothing.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from mercury_jax.chat import parse_assistant
from mercury_jax.envs.browse.sufficiency import answer_shown, evidence_sufficient
from mercury_jax.envs.browse.tasks import extract_answer, normalize_answer

STOP_RULES: dict[str, float] = {
    "correct_stop": 1.0,
    "continue_insufficient": 1.0,
    "over_search": 0.0,
    "premature": 0.0,
    "ungrounded": 0.0,
    "wrong": 0.0,
    "malformed": 0.0,
}


def verify_stop(task: Mapping, prefix: Sequence[Mapping], continuation: str, *,
                tools: Sequence[Mapping] | None = None, rules: Mapping[str, float] | None = None) -> dict:
    """{"reward", "outcome", "evidence_sufficient", "answer"} for `continuation` after chat `prefix`."""
    weights = dict(STOP_RULES, **(rules or {}))
    unknown = set(weights) - set(STOP_RULES)
    if unknown:
        raise ValueError(f"unknown stop-verifier rules {sorted(unknown)}; known: {sorted(STOP_RULES)}")
    sufficient = evidence_sufficient(task, prefix)
    turn = parse_assistant(continuation, tools)
    answer = extract_answer(turn.content or "")
    if turn.errors or (answer is None) == (not turn.tool_calls):
        outcome = "malformed"
    elif turn.tool_calls:
        outcome = "over_search" if sufficient else "continue_insufficient"
    elif not sufficient:
        outcome = "premature"
    elif not answer_shown(answer, prefix):
        outcome = "ungrounded"
    elif normalize_answer(answer) != normalize_answer(task["answer"]):
        outcome = "wrong"
    else:
        outcome = "correct_stop"
    return {"reward": weights[outcome], "outcome": outcome, "evidence_sufficient": sufficient, "answer": answer}
