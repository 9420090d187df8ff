"""The tasks a config's `world` section names: the train or eval split (from a corpus directory, or generated in
process with disjoint seeds), their tool schemas and the scripted solver's chats."""
from __future__ import annotations

import asyncio

import grain
import ml_collections

from mercury_jax.envs.episode import make_episode, oracle_trajectory
from mercury_jax.envs.generate import TaskSource
from mercury_jax.envs.presets import preset_tasks


def world_tasks(world: ml_collections.ConfigDict, split: str) -> list[dict]:
    """Train or eval tasks: from the corpus directory if set, else generated in process (disjoint seeds). A corpus's
    train split is a lazy grain source (records n_eval .. n_eval + num_train_tasks, read when a run reaches them, so
    each host of a pod reads only its own episodes' tasks); the eval split is a list."""
    if world.corpus_dir:
        source = TaskSource(world.corpus_dir)
        n_eval = world.num_eval_tasks
        if split == "train":
            return grain.MapDataset.source(source).slice(slice(n_eval, n_eval + world.num_train_tasks))
        return [source[i] for i in range(min(n_eval, len(source)))]
    seed, count = ((world.train_seed, world.num_train_tasks) if split == "train"
                   else (world.eval_seed, world.num_eval_tasks))
    tasks: list[dict] = []
    for world_seed in range(seed, seed + 100 * count):  # one seed is one company with a few distinct tasks
        tasks += preset_tasks(world.name, world.size, world_seed, min(world.tasks_per_world, count - len(tasks)))
        if len(tasks) >= count:
            return tasks
    raise ValueError(f"could not generate {count} {world.name} tasks; lower world.num_{split}_tasks")


def tool_schemas(tasks: list[dict]) -> list[list[dict]]:
    """The OpenAI-style tool schemas each task's episode offers (as the rollout renders them)."""
    async def one(task):
        async with make_episode(task) as episode:
            return await episode.tools()

    async def all_tasks():
        return [await one(task) for task in tasks]

    return asyncio.run(all_tasks())


def oracle_messages(tasks: list[dict], options: dict | None = None) -> list[list[dict]]:
    """The scripted solver's chats; `options` set the browsing oracle's `OracleConfig` (e.g. over_search_prob)."""
    return [oracle_trajectory(task, **(options or {})) for task in tasks]
