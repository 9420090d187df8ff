"""Generate a task corpus: N worlds x M tasks as sharded JSONL (one task per line), deterministic and resumable.

    python -m mercury_jax.envs.generate --world enterprise --worlds 3865 --tasks-per-world 10 --out DIR
    python -m mercury_jax.envs.generate --world browse --worlds 1000 --tasks-per-world 10 --out DIR

World seeds are `first_seed .. first_seed + worlds - 1`; shard k holds worlds [k*S, (k+1)*S) (`--shard-worlds` S)
as `DIR/{world}-{k:05d}-of-{n:05d}.jsonl`, written to a temporary file and renamed, with its statistics next to
it (`.stats.json`), so a rerun skips finished shards and redoes a half-written one. Lines are
`json.dumps(task, sort_keys=True)`: the same arguments give the same bytes. `DIR/summary.json` holds task counts
per template (or per hop count), the tool-count distribution and the generation time; `read_tasks(DIR)` yields
the tasks back, and `TaskSource(DIR, shard_index=host, shard_count=hosts)` is a grain random-access source.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from mercury_jax.envs.enterprise.effects import grade_state
from mercury_jax.envs.enterprise.oracle import run_script
from mercury_jax.envs.enterprise.tasks import initial_state
from mercury_jax.envs.episode import grade_browse, oracle_trajectory
from mercury_jax.envs.presets import preset_tasks


def task_line(task: dict) -> str:
    return json.dumps(task, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"


def world_tasks(world: str, preset: str, seed: int, count: int) -> list[dict]:
    return preset_tasks(world, preset, seed, count)


def generate(world: str, worlds: int, tasks_per_world: int, out: str | Path, *, preset: str = "full",
             first_seed: int = 0, shard_worlds: int = 100, progress: bool = True) -> dict:
    """Write the corpus (skipping finished shards) and return the summary (also written to summary.json)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = (worlds + shard_worlds - 1) // shard_worlds
    start = time.perf_counter()
    bar = _progress(worlds, progress, f"{world} worlds")
    stats = []
    for k in range(shards):
        path = out / f"{world}-{k:05d}-of-{shards:05d}.jsonl"
        stats_path = path.with_suffix(".stats.json")
        seeds = range(first_seed + k * shard_worlds, first_seed + min(worlds, (k + 1) * shard_worlds))
        if path.exists() and stats_path.exists():
            stats.append(json.loads(stats_path.read_text()))
            bar.update(len(seeds))
            continue
        tmp = path.with_suffix(".jsonl.tmp")
        shard_stats = {"templates": collections.Counter(), "tool_counts": collections.Counter(), "tasks": 0}
        with open(tmp, "w", encoding="utf-8") as file:
            for seed in seeds:
                for task in world_tasks(world, preset, seed, tasks_per_world):
                    file.write(task_line(task))
                    shard_stats["tasks"] += 1
                    shard_stats["templates"][task.get("template") or f"{task.get('hops')}-hop"] += 1
                    shard_stats["tool_counts"][str(len(task["tool_names"]))] += 1
                bar.update(1)
        os.replace(tmp, path)
        stats_path.write_text(json.dumps(shard_stats, sort_keys=True))
        stats.append(json.loads(stats_path.read_text()))
    bar.close()
    summary = _summary(world, preset, worlds, tasks_per_world, first_seed, stats, out)
    summary["seconds_this_run"] = round(time.perf_counter() - start, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


def read_tasks(path: str | Path) -> Iterator[dict]:
    """Tasks from one JSONL shard, or from every shard of a corpus directory in order."""
    path = Path(path)
    files = sorted(glob.glob(str(path / "*.jsonl"))) if path.is_dir() else [str(path)]
    for name in files:
        with open(name, encoding="utf-8") as file:
            for line in file:
                yield json.loads(line)


class TaskSource:
    """Random access to the tasks of a corpus directory for grain (`grain.MapDataset.source(TaskSource(DIR))`).

    Host `shard_index` of `shard_count` takes every `shard_count`-th shard file; records are indexed by byte
    offset once, and each read opens the file, so the source pickles cheaply into grain workers.
    """

    def __init__(self, directory: str | Path, *, shard_index: int = 0, shard_count: int = 1):
        files = sorted(glob.glob(str(Path(directory) / "*.jsonl")))
        if not files:
            raise FileNotFoundError(f"no *.jsonl shards in {directory}; write them with "
                                    "python -m mercury_jax.envs.generate --out DIR")
        self.files = files[shard_index::shard_count]
        self.index: list[tuple[int, int]] = []
        for k, name in enumerate(self.files):
            offset = 0
            with open(name, "rb") as file:
                for line in file:
                    self.index.append((k, offset))
                    offset += len(line)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        k, offset = self.index[i]
        with open(self.files[k], "rb") as file:
            file.seek(offset)
            return json.loads(file.readline())


def _summary(world, preset, worlds, tasks_per_world, first_seed, stats, out: Path) -> dict:
    templates, tool_counts = collections.Counter(), collections.Counter()
    for s in stats:
        templates.update(s["templates"])
        tool_counts.update(s["tool_counts"])
    counts = [int(c) for c, n in tool_counts.items() for _ in range(n)]
    files = sorted(out.glob(f"{world}-*.jsonl"))
    return {"world": world, "preset": preset, "worlds": worlds, "tasks_per_world": tasks_per_world,
            "first_seed": first_seed, "tasks": sum(s["tasks"] for s in stats),
            "templates": dict(sorted(templates.items())),
            "tool_counts": {k: tool_counts[k] for k in sorted(tool_counts, key=int)},
            "tool_count_mean": round(statistics.mean(counts), 3) if counts else 0.0,
            "tool_count_min": min(counts, default=0), "tool_count_max": max(counts, default=0),
            "bytes": sum(f.stat().st_size for f in files), "shards": len(files)}


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm  # noqa: PLC0415  (optional: a progress bar when tqdm is installed)
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="world", file=sys.stderr, mininterval=1.0)


def verify_oracle(directory: str | Path, limit: int | None = None) -> tuple[str, int, int, float]:
    """Replay the oracle on the first `limit` tasks of a corpus (all when None), directly on the state:
    (world, tasks with all_effects_pass, tasks checked, seconds)."""

    start, passed, checked, world = time.perf_counter(), 0, 0, "?"
    for task in read_tasks(directory):
        if limit is not None and checked >= limit:
            break
        world = task["world"]
        if world == "enterprise":
            db = initial_state(task)
            run_script(task, db)
            ok = grade_state(task["required_effects"], task["forbidden_effects"], initial_state(task), db)
        else:
            messages = oracle_trajectory(task)
            ok = grade_browse(task, messages[-1]["content"], messages)
        passed += bool(ok["all_effects_pass"])
        checked += 1
    return world, passed, checked, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", choices=("enterprise", "browse"))
    parser.add_argument("--worlds", type=int, default=3865)
    parser.add_argument("--tasks-per-world", type=int, default=10)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", choices=("full", "tiny"), default="full")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--shard-worlds", type=int, default=100)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.world is None:
        parser.error("--world is required (the timed benchmark of both corpora is python -m mercury_jax.bench.worlds)")
    summary = generate(args.world, args.worlds, args.tasks_per_world, args.out, preset=args.preset,
                       first_seed=args.first_seed, shard_worlds=args.shard_worlds, progress=not args.no_progress)
    print(f"{summary['tasks']} {args.world} tasks from {args.worlds} worlds in {summary['shards']} shards, "
          f"{summary['bytes'] / 1e6:.1f} MB, {summary['seconds_this_run']} s this run")
    print("tasks per template:", json.dumps(summary["templates"]))
    print(f"tools per task: mean {summary['tool_count_mean']}, min {summary['tool_count_min']}, "
          f"max {summary['tool_count_max']}; histogram {json.dumps(summary['tool_counts'])}")
    return summary


if __name__ == "__main__":
    main()
