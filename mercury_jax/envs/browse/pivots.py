"""Stop-decision pivot states (docs/ALGORITHMS.md, pipeline 2) cut from browsing trajectories.

A state is the chat prefix before an assistant turn. With `s_k` = evidence sufficient before turn k:
- `just_sufficient`: `s_k` and not `s_{k-1}` (evidence has just become sufficient: answer or search on?);
- `one_step_before`: not `s_k` but `s_{k+1}` (the next turn makes it sufficient).
Each pivot carries its label (`evidence_sufficient`), what the trajectory did next, and provenance.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from mercury_jax.envs.browse.sufficiency import evidence_sufficient


def extract_pivots(task: Mapping, messages: Sequence[Mapping], *, source: str = "oracle",
                   policy_version: int | str | None = None) -> list[dict]:
    """Pivot states of one trajectory (`messages` from `oracle_trajectory` or a rollout, same format)."""
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    sufficient = [evidence_sufficient(task, messages[:k]) for k in turns]
    pivots = []
    for j, k in enumerate(turns):
        before = sufficient[j - 1] if j > 0 else False
        after = sufficient[j + 1] if j + 1 < len(turns) else sufficient[j]
        kind = ("just_sufficient" if sufficient[j] and not before
                else "one_step_before" if not sufficient[j] and after else None)
        if kind is None:
            continue
        action = "tool_call" if messages[k].get("tool_calls") else "answer"
        pivots.append({"task_id": task["task_id"], "turn_index": j, "kind": kind,
                       "evidence_sufficient": sufficient[j], "prefix": [dict(m) for m in messages[:k]],
                       "next_action": action,
                       "provenance": {"source": source, "policy_version": policy_version,
                                      "message_index": k, "task_seed": task["seed"]}})
    return pivots


def write_pivots(pivots: Iterable[Mapping], path) -> int:
    """Append pivots to a JSONL file; returns how many were written."""
    count = 0
    with open(path, "a", encoding="utf-8") as file:
        for pivot in pivots:
            file.write(json.dumps(pivot, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
    return count
