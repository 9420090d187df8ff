"""The pivot dataset of pivot GRPO (docs/ALGORITHMS.md, pipeline 2): stop-decision states of a browsing agent.

Builder: run the starting policy (`source="policy"`: its own episodes through the rollout engine) or, for the tiny
demo, the scripted browsing oracle with its over-search habit (`source="oracle"`) on browsing tasks, cut each
trajectory into pivot states with `envs.browse.pivots.extract_pivots` (labels `evidence_sufficient`, `kind`,
`next_action`, provenance), and write one JSON object per line. Each line also carries its `task` (the world is
rebuilt from the task's seed, so a line is self-contained: the trainer mounts its tools and verifies
continuations from it). Reader: `read_pivots(path)` -> the records, in file order.

A state's prompt is its chat prefix rendered with the task's tools and tokenised as the rollout tokenises a chat
(`trajectory_from_messages`: system + user with the generation prompt, assistant turns, observations ending in the
next turn's generation prompt), so a continuation is exactly "the next assistant turn".
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from mercury_jax.chat import parse_assistant
from mercury_jax.config.grpo_rules import PIVOT_SOURCES
from mercury_jax.config.world import tool_schemas
from mercury_jax.envs.browse.pivots import extract_pivots, write_pivots
from mercury_jax.envs.episode import oracle_trajectory
from mercury_jax.parallel.distributed import barrier, is_primary
from mercury_jax.rollout.messages import trajectory_from_messages
from mercury_jax.rollout.trajectory import Trajectory
from mercury_jax.runs.rundir import as_path


def build_pivots(tasks: Sequence[Mapping], path: str | os.PathLike, *, source: str,
                 oracle_options: Mapping | None = None, run_episodes=None, policy_version: int | str | None = None,
                 kinds: Sequence[str] = ("just_sufficient", "one_step_before")) -> dict:
    """Write the pivots of `tasks` to `path` (JSONL, replaced if present); returns counts for the log.

    `source="oracle"`: `oracle_trajectory(task, **oracle_options)`. `source="policy"`: `run_episodes(tasks)` ->
    `Trajectory` list (e.g. `EpisodeRunner.run` on the starting policy); their chats are rebuilt from the sampled
    turns and tool results (`trajectory_messages`). Only pivots whose `kind` is in `kinds` are kept. Provenance:
    source, `policy_version` (which policy sampled the trajectory), the message index of the cut, the task's
    seed, and for the oracle its options.
    """

    if source not in PIVOT_SOURCES:
        raise ValueError(f"pivot source {source!r} is not one of {PIVOT_SOURCES}")
    if source == "oracle":
        chats = [oracle_trajectory(task, **dict(oracle_options or {})) for task in tasks]
    else:
        if run_episodes is None:
            raise ValueError("source='policy' needs run_episodes(tasks) -> trajectories of the starting policy")
        trajectories = run_episodes(list(tasks))
        failed = {i for i, t in enumerate(trajectories) if t.env_failure is not None}  # no pivots from a broken env
        tasks = [task for i, task in enumerate(tasks) if i not in failed]
        trajectories = [t for i, t in enumerate(trajectories) if i not in failed]
        chats = [trajectory_messages(task, t, tools) for task, t, tools in
                 zip(tasks, trajectories, task_tool_schemas(tasks))]
    path = as_path(path)
    writer = is_primary()  # every process computes the pivots (the policy's episodes are collective); one writes
    tmp = path.parent / (path.name + ".tmp")
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
    counts = {"tasks": len(tasks), "pivots": 0, "sufficient": 0, "tasks_with_pivots": 0}
    for task, messages in zip(tasks, chats):
        pivots = [dict(p, task=dict(task)) for p in extract_pivots(task, messages, source=source,
                                                                     policy_version=policy_version)
                  if p["kind"] in kinds]
        if source == "oracle":
            for pivot in pivots:
                pivot["provenance"]["oracle_options"] = dict(oracle_options or {})
        counts["pivots"] += write_pivots(pivots, tmp) if writer else len(pivots)
        counts["sufficient"] += sum(p["evidence_sufficient"] for p in pivots)
        counts["tasks_with_pivots"] += bool(pivots)
    if writer:
        tmp.touch()
        tmp.replace(path)  # a killed build never leaves a partial dataset behind under the final name
    barrier("pivot dataset written")
    return counts


def read_pivots(path: str | os.PathLike) -> list[dict]:
    """The pivot records of a JSONL file, in file order."""
    path = as_path(path)
    if not path.exists():
        raise FileNotFoundError(f"pivot dataset {path} does not exist; build it (grpo.pivots_path='' builds one into "
                                f"the workdir) or point grpo.pivots_path at an existing JSONL")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for n, record in enumerate(records):
        missing = {"task", "prefix", "evidence_sufficient", "provenance"} - set(record)
        if missing:
            raise ValueError(f"{path} line {n + 1} lacks {sorted(missing)}; rebuild the dataset with "
                             f"mercury_jax.train.pivot_data.build_pivots")
    return records


def trajectory_messages(task: Mapping, trajectory: Trajectory, tools: Sequence[Mapping] | None = None
                        ) -> list[dict]:
    """A rollout's chat (as `EpisodeRunner` saw it): system + user, each sampled turn parsed (with the task's
    `tools`, as the runner parses it) into a message, then the tool results of that turn."""
    messages = [{"role": "system", "content": task.get("system_prompt") or ""},
                {"role": "user", "content": task["user_prompt"]}]
    if not messages[0]["content"]:
        messages = messages[1:]
    for turn, text in enumerate(trajectory.assistant_texts):
        messages.append(parse_assistant(text, tools).to_message())
        messages += [{"role": "tool", "name": r["name"], "content": r["text"]}
                     for r in trajectory.tool_results if r["turn"] == turn]
    return messages


def prompt_ids(tokenizer, prefix: Sequence[Mapping], tools: Sequence[Mapping] | None) -> list[int]:
    """Token ids of a pivot state: its chat prefix with the generation prompt of the next assistant turn."""
    return trajectory_from_messages(tokenizer, prefix, tools).tokens


def task_tool_schemas(tasks: Sequence[Mapping]) -> list[list[dict]]:
    """The tool schemas of each task's episode, mounted once per distinct (world, tool_names): the schemas depend
    on the tool set only, not on the task's corpus."""

    keys = [(task["world"], tuple(task["tool_names"])) for task in tasks]
    cache: dict = {}
    for key, task in zip(keys, tasks):
        if key not in cache:
            cache[key] = tool_schemas([task])[0]
    return [cache[key] for key in keys]
