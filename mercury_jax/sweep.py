"""Checkpoint sweep of a pivot-GRPO run: evaluate every saved checkpoint on the held-out browsing tasks and name
the checkpoint the released rule selects (docs/ALGORITHMS.md, pipeline 2, "Checkpoint selection").

    python -m mercury_jax.sweep --workdir runs/grpo [--steps 0,20,40] [--num-tasks 256] [--seed S] \
        [--alpha 0.05] [--confidence 0.95] [--out DIR] [--recompute]

`--workdir` is a local path, a `file:///abs/path` URL or a `gs://` URI (read through `runs/run_reader.py`; gs://
needs the optional package gcsfs). For each checkpoint `WORKDIR/grpo/checkpoints/STEP` (ascending; step 0 is the
starting SFT policy and is always evaluated) the policy runs one full tool episode per held-out task
(`world_tasks(config.world, "eval")`, the first `--num-tasks`) with the run's rollout budgets and sampling, on the
run's rollout layout (`train/checkpoint_engine.py`): with `rollout.replica` (the released runs), replicas of that
shape over every device of every process, each checkpoint restored straight into their layout in
`rollout.param_dtype` (no host copy of the whole model); else one engine on the first device. One engine serves
every checkpoint (compiled once; new weights between checkpoints), and every checkpoint sees the same tasks in the
same order with the same sampling seed, so episode i of every checkpoint draws the same random numbers and the
outcomes are paired task by task. Run it on every process of a pod at once, like the trainers (`python -m
mercury_jax.sweep --workdir gs://...` on each host): the episodes spread over the hosts' replicas, and process 0
writes the outputs.

Per checkpoint (`evaluation/table.py`): accuracy and post-answer over-search rate with Wilson intervals and exact
McNemar p-values against step 0 (two-sided for accuracy, one-sided "lower" for over-search), and tool calls per
episode with a t interval. The rule (`evaluation/selection.py`) picks the latest step whose accuracy is
indistinguishable from step 0 while its over-search is significantly lower, else step 0.

Outputs in `--out` (default `WORKDIR/sweep/`): `sweep.json` (every record with its per-task outcomes, the
selection and its reason, the evaluation setup), `frontier.png`, and `outcomes/STEP.json` for each evaluated
checkpoint, reused by a rerun with the same setup (tasks, seed, budgets, sampling) unless `--recompute`.

Exit codes (`cli_errors.py`): 0 done; 2 refused (no such run or checkpoint, a run that is not pivot GRPO, a wrong
argument, a damaged checkpoint...), one `error:` line on stderr (`--debug` or MERCURY_DEBUG=1 adds the traceback);
1 a bug, with its traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from mercury_jax import cli_errors
from mercury_jax.config.world import world_tasks
from mercury_jax.evaluation import (
    EpisodeOutcomes,
    checkpoint_record,
    format_table,
    outcomes_from_trajectories,
    plot_frontier,
    select_checkpoint,
)
from mercury_jax.evaluation.selection import START_STEP
from mercury_jax.parallel import distributed
from mercury_jax.parallel.distributed import is_primary
from mercury_jax.rollout.engine import Engine
from mercury_jax.runs.run_reader import EVAL_SEED_OFFSET, RunReader, RunReadError, eval_seed
from mercury_jax.runs.rundir import as_path, is_local, write_atomically
from mercury_jax.train.checkpoint_engine import CheckpointEngine

STAGE = "grpo"
ROLLOUT_FIELDS = ("max_tool_turns", "max_total_tokens", "max_turn_tokens", "temperature", "top_p", "num_slots")


class SweepError(ValueError):
    """The sweep cannot run as asked; the message says what is missing and how to get it."""


def sweep_steps(workdir: str | os.PathLike | RunReader, requested: list[int] | None = None) -> list[int]:
    """The checkpoint steps to evaluate, ascending, always including the starting policy (step 0)."""
    reader = workdir if isinstance(workdir, RunReader) else RunReader(workdir)
    checkpoint_dir = os.fspath(reader.checkpoints(STAGE))
    available = reader.steps(STAGE)
    if not available:
        raise SweepError(f"no {STAGE} checkpoint in {checkpoint_dir}: train the run first (`python -m "
                         f"mercury_jax.main --config experiments/grpo.py --workdir {workdir}` saves step 0, the "
                         f"starting policy, and then every checkpoint.every steps)")
    if START_STEP not in available:
        raise SweepError(f"{checkpoint_dir} has no step {START_STEP} (the starting policy every checkpoint is "
                         f"compared with); available steps: {available}. Keep step 0 when pruning checkpoints")
    steps = available if requested is None else sorted(set(requested) | {START_STEP})
    missing = [s for s in steps if s not in available]
    if missing:
        raise SweepError(f"{STAGE} checkpoint step(s) {missing} do not exist in {checkpoint_dir}; available steps: "
                         f"{available}")
    return steps


def run_sweep(workdir: str | Path, *, steps: list[int] | None = None, num_tasks: int | None = None,
              seed: int | None = None, alpha: float = 0.05, confidence: float = 0.95, out: str | Path | None = None,
              recompute: bool = False, stream: TextIO = sys.stdout,
              load_policy: Callable | None = None, make_engine: Callable = Engine) -> dict:
    """Evaluate the checkpoints, select one, write `sweep.json` and `frontier.png` to `out` (process 0); returns
    the summary (on every process).

    Seams of the single-engine layout (`train/checkpoint_engine.py`): `load_policy(reader, step)` gives the model of
    a checkpoint and `make_engine(model, num_slots=, max_length=, policy_version=)` the engine that samples it
    (tests pass scripted ones)."""
    if not 0 < alpha < 1 or not 0 < confidence < 1:
        raise SweepError(f"--alpha {alpha} and --confidence {confidence} must lie in (0, 1)")
    reader = RunReader(workdir)
    if not reader.exists():
        raise SweepError(f"workdir {workdir} does not exist; pass the directory of a pivot-GRPO run")
    config = _run_config(reader)
    steps = sweep_steps(reader, steps)
    tasks = _held_out_tasks(config, num_tasks)
    seed = eval_seed(config) if seed is None else seed
    out = as_path(out) if out is not None else reader.run.sweep
    setup_key = {"task_ids": [str(t.get("task_id", i)) for i, t in enumerate(tasks)], "seed": seed,
                 "rollout": {name: config.rollout[name] for name in ROLLOUT_FIELDS}}
    say = _printer(stream)
    say(f"[sweep] {os.fspath(reader.root)}: {len(steps)} checkpoints {steps}, {len(tasks)} held-out "
        f"{config.world.name} tasks, sampling seed {seed}")

    outcomes = _evaluate(reader, steps, tasks, setup_key, out, recompute, say,
                         lambda: CheckpointEngine(reader, STAGE, load_policy=load_policy, make_engine=make_engine))
    records = [checkpoint_record(step, outcomes[step], outcomes[START_STEP], confidence=confidence)
               for step in steps]
    selection = select_checkpoint(records, alpha)
    plot = out / "frontier.png"
    if is_primary():
        _write_plot(records, selection.step, plot, confidence=confidence, title=f"{reader.name}: accuracy vs "
                    f"over-search per checkpoint\n{len(tasks)} held-out tasks, {confidence:.0%} Wilson intervals")
    summary = {"workdir": os.fspath(reader.root), "stage": STAGE, "steps": steps, "num_tasks": len(tasks),
               "alpha": alpha, "confidence": confidence, **setup_key,
               "selection": {"step": selection.step, "reason": selection.reason,
                             "qualifying": list(selection.qualifying),
                             "verdicts": {str(k): v for k, v in selection.verdicts.items()}},
               "records": records, "frontier_plot": os.fspath(plot)}
    write_atomically(out / "sweep.json", json.dumps(summary, indent=1) + "\n")
    say(format_table(records, selection.verdicts))
    say(f"[sweep] selected checkpoint: step {selection.step} ({selection.reason})\n"
        f"[sweep] wrote {os.fspath(out / 'sweep.json')} and {os.fspath(plot)}")
    return summary


def _printer(stream: TextIO) -> Callable[[str], None]:
    """Progress lines, printed by process 0 only (every process runs the same sweep)."""
    def say(text: str) -> None:
        if is_primary():
            print(text, file=stream, flush=True)
    return say


def _write_plot(records, step: int, path: epath.Path, **options) -> None:
    """`plot_frontier` to `path`, through a local file when `path` is remote (matplotlib writes local files)."""
    if is_local(path):
        plot_frontier(records, step, Path(os.fspath(path)), start_step=START_STEP, **options)
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = plot_frontier(records, step, Path(tmp) / path.name, start_step=START_STEP, **options)
        path.write_bytes(local.read_bytes())


def _run_config(reader: RunReader):
    workdir = os.fspath(reader.root)
    try:
        config = reader.config
    except RunReadError as error:
        raise SweepError(f"{error} (a pivot-GRPO run started with `python -m mercury_jax.main --config "
                         f"experiments/grpo.py --workdir {workdir}` writes it)") from None
    if config.world.name != "browse":
        raise SweepError(f"the sweep evaluates browsing tasks, but {workdir}'s world is {config.world.name!r} "
                         f"(world.name); point --workdir at a pivot-GRPO run")
    missing = [name for name in ROLLOUT_FIELDS if name not in config.get("rollout", {})]
    if missing:
        raise SweepError(f"{workdir}/config.json has no rollout.{', rollout.'.join(missing)}; the sweep runs "
                         f"episodes with the run's rollout budgets and sampling")
    return config


def _held_out_tasks(config, num_tasks: int | None) -> list[dict]:
    held_out = config.world.num_eval_tasks
    if num_tasks is not None and not 0 < num_tasks <= held_out:
        raise SweepError(f"--num-tasks {num_tasks}: the run holds out {held_out} tasks (world.num_eval_tasks); "
                         f"use 1..{held_out} (more would draw on tasks the run may have trained on)")
    return world_tasks(config.world, "eval")[:num_tasks or held_out]


def _evaluate(reader: RunReader, steps: list[int], tasks: list[dict], setup_key: dict, out: epath.Path,
              recompute: bool, say, make_engine) -> dict[int, EpisodeOutcomes]:
    """Per-task outcomes of each step: from `out/outcomes/STEP.json` when its setup matches, else by rollouts."""
    cache_dir = out / "outcomes"
    if is_primary():
        cache_dir.mkdir(parents=True, exist_ok=True)
    cached = {step: None if recompute else _read_cached(cache_dir / f"{step}.json", setup_key) for step in steps}
    to_run = _agreed([step for step in steps if cached[step] is None])
    outcomes = {step: cached[step] for step in steps if step not in to_run}
    for step in outcomes:
        say(f"[sweep] step {step}: outcomes reused from {os.fspath(cache_dir / f'{step}.json')}")
    if not to_run:
        return outcomes
    engine, runner = None, None
    started = time.perf_counter()
    for done, step in enumerate(to_run, start=1):
        if engine is None:
            try:
                engine = make_engine()
            except ValueError as error:  # the layout's own checks (slots, replica size vs the hosts' devices)
                raise SweepError(f"the run's rollout layout does not fit this sweep's devices: {error}") from None
        engine.load(step)
        if runner is None:
            runner = engine.runner(setup_key["seed"])
            say(f"[sweep] rollout layout: {engine.num_replicas} replica(s) of {engine.replica or 'one device'}, "
                f"{engine.slots} slots each, weights in {engine.param_dtype or 'the checkpoint dtype'}")
        trajectories = runner.run(tasks, first_episode_id=0)  # same episode ids -> same sampling keys every step
        outcomes[step] = outcomes_from_trajectories(trajectories)
        write_atomically(cache_dir / f"{step}.json", json.dumps(
            {"setup": setup_key, "step": step, "outcomes": dataclasses.asdict(outcomes[step])}) + "\n")
        elapsed = time.perf_counter() - started
        result = outcomes[step]
        n = len(result.task_ids)
        say(f"[sweep] step {step} ({done}/{len(to_run)}): accuracy {sum(result.correct) / n:.3f}, over-search "
            f"{sum(result.over_searched) / n:.3f}, tool calls {sum(result.tool_calls) / n:.2f} | "
            f"{elapsed:.0f}s elapsed, ETA {elapsed / done * (len(to_run) - done):.0f}s")
    return outcomes


def _agreed(steps: list[int]) -> list[int]:
    """Process 0's list of `steps` on every process (each read the cached outcomes itself; a file written between
    two reads must not make one process run a checkpoint the others skip)."""
    if jax.process_count() == 1:
        return steps
    mask = np.zeros((max(len(steps), 1 << 12),), np.int32)
    mask[:len(steps)] = np.asarray(steps, np.int32) + 1
    agreed = multihost_utils.broadcast_one_to_all(mask)
    return [int(s) - 1 for s in agreed if s]


def _read_cached(path: epath.Path, setup_key: dict) -> EpisodeOutcomes | None:
    """The stored outcomes of a step if they were made with `setup_key` (same tasks, seed, budgets, sampling)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return EpisodeOutcomes(**data["outcomes"]) if data.get("setup") == setup_key else None
    except (ValueError, KeyError, TypeError):  # an unreadable file is rerun, not trusted
        return None


def _parse_steps(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SweepError(f"--steps {text!r}: give comma-separated checkpoint steps, e.g. 0,20,40") from None


def main(argv=None) -> None:
    """The command line (module docstring); exit codes in `cli_errors.py` (2: one `error:` line)."""
    cli_errors.run_entry_point(lambda: _main(argv), argv, extra=(SweepError,))


def _main(argv) -> None:
    parser = argparse.ArgumentParser(prog="python -m mercury_jax.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the pivot-GRPO run directory (config.json, grpo/checkpoints)")
    parser.add_argument("--steps", default=None, help="comma-separated steps (default: every checkpoint; 0 always)")
    parser.add_argument("--num-tasks", type=int, default=None, help="the first N held-out tasks (default: all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, the same for every checkpoint "
                        f"(default: config.seed + {EVAL_SEED_OFFSET})")
    parser.add_argument("--alpha", type=float, default=0.05, help="significance level of the selection rule")
    parser.add_argument("--confidence", type=float, default=0.95, help="level of the reported intervals")
    parser.add_argument("--out", default=None, help="output directory (default: WORKDIR/sweep)")
    parser.add_argument("--recompute", action="store_true", help="rerun every checkpoint's episodes (no reuse)")
    cli_errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    # multi-process JAX (every host of a pod runs the sweep) before anything touches a device
    distributed.initialize_for_main(sys.argv if argv is None else ["sweep", *argv])
    logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines would drown the progress lines
    run_sweep(args.workdir, steps=None if args.steps is None else _parse_steps(args.steps), num_tasks=args.num_tasks,
              seed=args.seed, alpha=args.alpha, confidence=args.confidence, out=args.out, recompute=args.recompute)


if __name__ == "__main__":
    main()
