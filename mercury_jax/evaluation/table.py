"""Per-checkpoint records of the sweep: per-task episode outcomes -> rates with intervals and paired p-values
against the starting policy, and the printed table.

Metrics of one checkpoint over its n held-out episodes (one per task; `grade_browse` in envs/episode.py):
- accuracy = #(final answer matches the gold answer) / n, Wilson interval, two-sided exact McNemar p against
  the start (`p_accuracy`: is it distinguishable at all?).
- over-search rate = #(episodes with a tool call after the evidence became sufficient) / n, Wilson interval,
  one-sided exact McNemar p for "lower than the start" (`p_over_search`). The denominator is every episode, so
  the pairs stay complete; an episode whose evidence never became sufficient cannot over-search.
- tool calls = mean tool calls per episode, Student-t interval.
Extras kept in the record (not tested): mean over-search calls, evidence-sufficient, grounded and truncation rates.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from mercury_jax.evaluation.stats import mcnemar_exact, mean_interval, wilson_interval

TRUNCATED = ("token_budget", "degenerate")


@dataclasses.dataclass
class EpisodeOutcomes:
    """What the sweep needs from one checkpoint's episodes, task by task (index i = the i-th held-out task)."""
    task_ids: list[str]
    correct: list[bool]
    over_searched: list[bool]          # over_search_calls > 0
    tool_calls: list[int]
    over_search_calls: list[int] = dataclasses.field(default_factory=list)
    evidence_sufficient: list[bool] = dataclasses.field(default_factory=list)
    grounded: list[bool] = dataclasses.field(default_factory=list)
    truncated: list[bool] = dataclasses.field(default_factory=list)
    token_digests: list[str] = dataclasses.field(default_factory=list)  # `episode_digest` of each episode

    def __post_init__(self):
        for field in dataclasses.fields(self):
            values = getattr(self, field.name)
            if values and len(values) != len(self.task_ids):
                raise ValueError(f"EpisodeOutcomes.{field.name} has {len(values)} entries for "
                                 f"{len(self.task_ids)} tasks")


def episode_digest(tokens) -> str:
    """A short hash of an episode's token ids: two evaluations sampled the same episode iff these agree (the sweep
    on another rollout layout or process count must give the same ones)."""
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:16]


def outcomes_from_trajectories(trajectories: Sequence) -> EpisodeOutcomes:
    """Read the browse grade (`trajectory.reward_parts["grade"]`) and tool calls of each trajectory."""
    grades = []
    for trajectory in trajectories:
        grade = trajectory.reward_parts.get("grade", {})
        if "accuracy" not in grade or "over_search_calls" not in grade:
            raise ValueError(f"trajectory of task {trajectory.task_id} has no browse grade (accuracy, "
                             f"over_search_calls); the sweep evaluates browsing tasks (world.name = 'browse')")
        grades.append(grade)
    return EpisodeOutcomes(
        task_ids=[t.task_id for t in trajectories],
        correct=[bool(g["accuracy"]) for g in grades],
        over_searched=[int(g["over_search_calls"]) > 0 for g in grades],
        tool_calls=[len(t.tool_calls) for t in trajectories],
        over_search_calls=[int(g["over_search_calls"]) for g in grades],
        evidence_sufficient=[bool(g.get("evidence_sufficient")) for g in grades],
        grounded=[bool(g.get("grounded")) for g in grades],
        truncated=[t.finish_reason in TRUNCATED for t in trajectories],
        token_digests=[episode_digest(t.tokens) for t in trajectories])


def checkpoint_record(step: int, outcomes: EpisodeOutcomes, start: EpisodeOutcomes, *,
                      confidence: float = 0.95) -> dict:
    """One row of the sweep table: rates, intervals and p-values of `outcomes` against the start's (paired)."""
    if outcomes.task_ids != start.task_ids:
        raise ValueError(f"step {step} was evaluated on other tasks than the starting policy; the paired test needs "
                         f"the same task list in the same order")
    n = len(outcomes.task_ids)
    if n == 0:
        raise ValueError(f"step {step}: no episodes to summarise")
    record = {
        "step": step,
        "num_tasks": n,
        "accuracy": sum(outcomes.correct) / n,
        "accuracy_ci": list(wilson_interval(sum(outcomes.correct), n, confidence)),
        "p_accuracy": mcnemar_exact(start.correct, outcomes.correct, "two-sided"),
        "over_search_rate": sum(outcomes.over_searched) / n,
        "over_search_ci": list(wilson_interval(sum(outcomes.over_searched), n, confidence)),
        "p_over_search": mcnemar_exact(start.over_searched, outcomes.over_searched, "less"),
        "tool_calls": sum(outcomes.tool_calls) / n,
        "tool_calls_ci": list(mean_interval([float(c) for c in outcomes.tool_calls], confidence)),
    }
    for name in ("over_search_calls", "evidence_sufficient", "grounded", "truncated"):
        values = getattr(outcomes, name)
        if values:
            record[f"mean_{name}" if name == "over_search_calls" else f"{name}_rate"] = sum(values) / n
    record["outcomes"] = dataclasses.asdict(outcomes)
    return record


def format_table(records: Sequence[Mapping], verdicts: Mapping[int, str]) -> str:
    """The sweep table as fixed-width text, one row per checkpoint in step order."""
    header = ("step", "accuracy [CI]", "p_acc", "over-search [CI]", "p_over", "tool calls [CI]", "verdict")
    rows = [header]
    for record in sorted(records, key=lambda r: r["step"]):
        rows.append((str(record["step"]),
                     _with_interval(record["accuracy"], record["accuracy_ci"]),
                     f"{record['p_accuracy']:.3g}",
                     _with_interval(record["over_search_rate"], record["over_search_ci"]),
                     f"{record['p_over_search']:.3g}",
                     _with_interval(record["tool_calls"], record["tool_calls_ci"], digits=2),
                     verdicts.get(record["step"], "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def _with_interval(value: float, interval: Sequence[float], digits: int = 3) -> str:
    return f"{value:.{digits}f} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
