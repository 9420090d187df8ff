"""Checkpoint sweep of a pivot-GRPO run: evaluate every saved checkpoint on the held-out browsing tasks and name
the checkpoint the released rule selects (docs/ALGORITHMS.md, pipeline 2, "Checkpoint selection").

    python -m mercury_jax.sweep --workdir runs/grpo [--steps 0,20,40] [--num-tasks 256] [--seed S] \
        [--alpha 0.05] [--confidence 0.95] [--out DIR] [--recompute]

For each checkpoint `WORKDIR/grpo/checkpoints/STEP` (ascending; step 0 is the starting SFT policy and is always
evaluated) the policy is restored as host arrays (`export.restore_policy`), put on the default device, and runs
one full tool episode per held-out task (`setup.world_tasks(config.world, "eval")`, the first `--num-tasks`) with
the run's rollout budgets and sampling. One `Engine` serves every checkpoint (compiled once; `update_weights`
between checkpoints), and every checkpoint sees the same tasks in the same order with the same sampling seed, so
episode i of every checkpoint draws the same random numbers and the outcomes are paired task by task.

Per checkpoint (`evaluation/table.py`): accuracy and post-answer over-search rate with Wilson intervals and exact
McNemar p-values against step 0 (two-sided for accuracy, one-sided "lower" for over-search), and tool calls per
episode with a t interval. The rule (`evaluation/selection.py`) picks the latest step whose accuracy is
indistinguishable from step 0 while its over-search is significantly lower, else step 0.

Outputs in `--out` (default `WORKDIR/sweep/`): `sweep.json` (every record with its per-task outcomes, the
selection and its reason, the evaluation setup), `frontier.png`, and `outcomes/STEP.json` for each evaluated
checkpoint, reused by a rerun with the same setup (tasks, seed, budgets, sampling) unless `--recompute`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax
from absl import logging
from flax import nnx

from mercury_jax.evaluation import (
    EpisodeOutcomes,
    checkpoint_record,
    format_table,
    outcomes_from_trajectories,
    plot_frontier,
    select_checkpoint,
)
from mercury_jax.evaluation.selection import START_STEP
from mercury_jax.export import ExportError, checkpoint_steps, load_run_config, restore_policy, run_tokenizer
from mercury_jax.rollout.engine import Engine
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.train.rundir import RunDir, write_atomically
from mercury_jax.train.setup import episode_reward, rollout_budgets, rollout_sampling, world_tasks

STAGE = "grpo"
EVAL_SEED_OFFSET = 1_000_003  # the default sampling seed is config.seed + this (as the SAO trainer's evaluations)
ROLLOUT_FIELDS = ("max_tool_turns", "max_total_tokens", "max_turn_tokens", "temperature", "top_p", "num_slots")


class SweepError(ValueError):
    """The sweep cannot run as asked; the message says what is missing and how to get it."""


def sweep_steps(workdir: str | Path, requested: list[int] | None = None) -> list[int]:
    """The checkpoint steps to evaluate, ascending, always including the starting policy (step 0)."""
    checkpoint_dir = Path(os.fspath(RunDir(workdir).stage(STAGE).checkpoints))
    available = checkpoint_steps(checkpoint_dir)
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


def policy_on_device(workdir: Path, step: int):
    """The run's policy at checkpoint `step`, restored from host arrays onto the first device."""
    model, _, _ = restore_policy(workdir, step=step, stage=STAGE)
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))


def run_sweep(workdir: str | Path, *, steps: list[int] | None = None, num_tasks: int | None = None,
              seed: int | None = None, alpha: float = 0.05, confidence: float = 0.95, out: str | Path | None = None,
              recompute: bool = False, stream: TextIO = sys.stdout,
              load_policy: Callable[[Path, int], Any] = policy_on_device, make_engine: Callable[..., Any] = Engine,
              ) -> dict:
    """Evaluate the checkpoints, select one, write `sweep.json` and `frontier.png` to `out`; returns the summary.

    Seams: `load_policy(workdir, step)` gives the model of a checkpoint and `make_engine(model, num_slots=,
    max_length=, policy_version=)` the engine that samples it (tests pass scripted ones)."""
    workdir = Path(workdir)
    if not 0 < alpha < 1 or not 0 < confidence < 1:
        raise SweepError(f"--alpha {alpha} and --confidence {confidence} must lie in (0, 1)")
    if not workdir.is_dir():
        raise SweepError(f"workdir {workdir} does not exist; pass the directory of a pivot-GRPO run")
    config = _run_config(workdir)
    steps = sweep_steps(workdir, steps)
    tasks = _held_out_tasks(config, num_tasks)
    seed = config.seed + EVAL_SEED_OFFSET if seed is None else seed
    out = Path(out) if out is not None else Path(os.fspath(RunDir(workdir).sweep))
    setup_key = {"task_ids": [str(t.get("task_id", i)) for i, t in enumerate(tasks)], "seed": seed,
                 "rollout": {name: config.rollout[name] for name in ROLLOUT_FIELDS}}
    print(f"[sweep] {workdir}: {len(steps)} checkpoints {steps}, {len(tasks)} held-out {config.world.name} tasks, "
          f"sampling seed {seed}", file=stream, flush=True)

    outcomes = _evaluate(workdir, config, steps, tasks, setup_key, out, recompute, stream, load_policy, make_engine)
    records = [checkpoint_record(step, outcomes[step], outcomes[START_STEP], confidence=confidence)
               for step in steps]
    selection = select_checkpoint(records, alpha)
    plot = plot_frontier(records, selection.step, out / "frontier.png", start_step=START_STEP,
                         confidence=confidence, title=f"{workdir.name}: accuracy vs over-search per checkpoint\n"
                         f"{len(tasks)} held-out tasks, {confidence:.0%} Wilson intervals")
    summary = {"workdir": str(workdir.absolute()), "stage": STAGE, "steps": steps, "num_tasks": len(tasks),
               "alpha": alpha, "confidence": confidence, **setup_key,
               "selection": {"step": selection.step, "reason": selection.reason,
                             "qualifying": list(selection.qualifying),
                             "verdicts": {str(k): v for k, v in selection.verdicts.items()}},
               "records": records, "frontier_plot": str(plot)}
    write_atomically(out / "sweep.json", json.dumps(summary, indent=1) + "\n")
    print(format_table(records, selection.verdicts), file=stream)
    print(f"[sweep] selected checkpoint: step {selection.step} ({selection.reason})\n"
          f"[sweep] wrote {out / 'sweep.json'} and {plot}", file=stream, flush=True)
    return summary


def _run_config(workdir: Path):
    try:
        config = load_run_config(workdir)
    except ExportError as error:
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


def _evaluate(workdir: Path, config, steps: list[int], tasks: list[dict], setup_key: dict, out: Path,
              recompute: bool, stream: TextIO, load_policy, make_engine) -> dict[int, EpisodeOutcomes]:
    """Per-task outcomes of each step: from `out/outcomes/STEP.json` when its setup matches, else by rollouts."""
    cache_dir = out / "outcomes"
    cache_dir.mkdir(parents=True, exist_ok=True)
    outcomes, to_run = {}, []
    for step in steps:
        cached = None if recompute else _read_cached(cache_dir / f"{step}.json", setup_key)
        if cached is not None:
            outcomes[step] = cached
            print(f"[sweep] step {step}: outcomes reused from {cache_dir / f'{step}.json'}", file=stream, flush=True)
        else:
            to_run.append(step)
    if not to_run:
        return outcomes
    runner, engine = None, None
    started = time.perf_counter()
    for done, step in enumerate(to_run, start=1):
        model = load_policy(workdir, step)
        if engine is None:
            runner, engine = _make_runner(model, config, setup_key["seed"], step, workdir, make_engine)
        else:
            engine.update_weights(model, step)
        del model
        trajectories = runner.run(tasks, first_episode_id=0)  # same episode ids -> same sampling keys every step
        outcomes[step] = outcomes_from_trajectories(trajectories)
        write_atomically(cache_dir / f"{step}.json", json.dumps(
            {"setup": setup_key, "step": step, "outcomes": dataclasses.asdict(outcomes[step])}) + "\n")
        elapsed = time.perf_counter() - started
        result = outcomes[step]
        n = len(result.task_ids)
        print(f"[sweep] step {step} ({done}/{len(to_run)}): accuracy {sum(result.correct) / n:.3f}, over-search "
              f"{sum(result.over_searched) / n:.3f}, tool calls {sum(result.tool_calls) / n:.2f} | "
              f"{elapsed:.0f}s elapsed, ETA {elapsed / done * (len(to_run) - done):.0f}s", file=stream, flush=True)
    return outcomes


def _read_cached(path: Path, setup_key: dict) -> EpisodeOutcomes | None:
    """The stored outcomes of a step if they were made with `setup_key` (same tasks, seed, budgets, sampling)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return EpisodeOutcomes(**data["outcomes"]) if data.get("setup") == setup_key else None
    except (ValueError, KeyError, TypeError):  # an unreadable file is rerun, not trusted
        return None


def _make_runner(model, config, seed: int, version: int, workdir: Path, make_engine=Engine):
    rollout = config.rollout
    engine = make_engine(model, num_slots=rollout.num_slots, max_length=rollout.max_total_tokens,
                         policy_version=version)
    runner = EpisodeRunner(engine, run_tokenizer(config, workdir), budgets=rollout_budgets(rollout),
                           reward=episode_reward(config), sampling=rollout_sampling(rollout, seed))
    return runner, engine


def _parse_steps(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SweepError(f"--steps {text!r}: give comma-separated checkpoint steps, e.g. 0,20,40") from None


def main(argv=None) -> None:


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
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.WARNING)  # Orbax's INFO lines would drown the progress lines
    try:
        run_sweep(args.workdir, steps=None if args.steps is None else _parse_steps(args.steps),
                  num_tasks=args.num_tasks, seed=args.seed, alpha=args.alpha, confidence=args.confidence,
                  out=args.out, recompute=args.recompute)
    except (SweepError, ExportError) as error:
        parser.exit(2, f"mercury_jax.sweep: error: {error}\n")


if __name__ == "__main__":
    main()
