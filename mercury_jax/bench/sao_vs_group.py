"""SAO against group-baseline RL on the tiny enterprise world, side by side: the SAO card's case, measured.

    python -m mercury_jax.bench.sao_vs_group              # 3 runs of 20 steps, then the tables into BENCHMARKS.md
    python -m mercury_jax.bench.sao_vs_group --runs "SAO sync,group sync" --steps 80    # the demo's length, sync
    python -m mercury_jax.bench.sao_vs_group --report     # the tables of the runs already in --root

A sync run's numbers do not depend on timing (episode e is request block e with the run's seed), so its learning
figures hold on a loaded host; its wall times and an async run's batches do not.

Three runs of `--steps` steps on one process and one CPU device, from one warm start (the SFT stage of the first
run, copied into the others, so all three start from the same weights):
- **SAO sync**: `experiments/sao.py:tiny`, 16 tasks x 1 episode a step, sampled with the latest weights;
- **group sync**: `experiments/group_baseline.py:tiny`, 2 tasks x 8 episodes a step (the same 16 episodes), the
  group's mean reward as the baseline of every generated token;
- **SAO async**: SAO with `rollout.mode=async` (the released mode): the rollout worker keeps sampling while the
  learner steps, no barrier.
Equal learner budget: the same steps, one actor update a step with the same optimiser, loss and episodes (SAO also
updates its critic, its only extra).

Per run: held-out reward (128 tasks, the same tasks and sampling seeds at every evaluation and in every run) before
and after, paired task by task against its own warm start and across runs; per step (the steps that compiled
nothing): wall time (and all steps' total, compiles included; the warm start and the evaluations are not
counted), the barrier wait (the slowest episode's time minus the mean episode's: how long the average
slot waits for the batch; `group_wait_s` the same within each group), the spread of episode lengths (action
tokens, min and max of a batch), the learner's idle share (waiting for its batch, `rollout_s` / step time) and the
rollout's idle share (1 - busy engine seconds / step time). On one machine the rollout and the learner share its
2 cores, so async overlaps them only as far as the CPU allows (BENCHMARKS "Async vs sync SAO on one machine").
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np

from mercury_jax.bench.async_sao import _copy_warm_start, _records
from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.evaluation.heldout import heldout_summary
from mercury_jax.evaluation.stats import paired_difference
from tests import local_processes  # the tests' launcher of `main` as N processes (run from a checkout)

RUN_TIMEOUT_S = 6 * 3600
# name: (config, stage, extra overrides); the first run trains the warm start the others copy
RUNS = {
    "SAO sync": ("experiments/sao.py:tiny", "sao", ["--config.rollout.mode=sync"]),
    "group sync": ("experiments/group_baseline.py:tiny", "group_baseline", []),
    "SAO async": ("experiments/sao.py:tiny", "sao", ["--config.rollout.mode=async"]),
}


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-")


def _run(name: str, root: Path, steps: int, eval_tasks: int) -> None:
    """One run to its end."""
    config, stage, extra = RUNS[name]
    workdir = root / _slug(name)
    overrides = [f"--config.{stage}.steps={steps}", f"--config.{stage}.eval_every=0",
                 f"--config.world.num_eval_tasks={eval_tasks}", *extra]
    print(f"{name}: {config} {' '.join(overrides)} (workdir {workdir})", flush=True)
    procs = local_processes.launch(["--config", config, "--workdir", str(workdir), *overrides], logs=root / "logs",
                                   processes=1, devices=1, name=_slug(name))
    local_processes.wait(procs, logs=root / "logs", timeout_s=RUN_TIMEOUT_S)


def _without_compiles(records: list[dict]) -> list[dict]:
    """The steps whose padded batch length was seen before in the run (a new one compiles the learner programs)."""
    seen, kept = set(), []
    for record in records:
        if record.get("batch_length") in seen:
            kept.append(record)
        seen.add(record.get("batch_length"))
    return kept


def _step_row(name: str, records: list[dict], all_records: list[dict]) -> list:
    step = np.array([r["step_time_s"] for r in records])
    rollout = np.array([r["rollout_s"] for r in records])
    busy = np.array([r.get("rollout_busy_s", 0.0) for r in records])
    barrier = "-" if "async" in name else f"{np.mean([r['barrier_wait_s'] for r in records]):.1f}"
    group = f"{np.mean([r['group_wait_s'] for r in records]):.1f}" if "group_wait_s" in records[0] else "-"
    spread = [r["response_length_max"] / max(r["response_length_min"], 1) for r in records]
    return [name, len(records), f"{step.mean():.1f}", barrier, group,
            f"{np.mean([r['response_length'] for r in records]):.0f} "
            f"({int(np.median([r['response_length_min'] for r in records]))}-"
            f"{int(np.median([r['response_length_max'] for r in records]))}; max/min {np.median(spread):.1f}x)",
            f"{rollout.sum() / step.sum():.0%}", f"{1 - busy.sum() / step.sum():.0%}",
            f"{sum(r['step_time_s'] for r in all_records) / 60:.1f}"]


def _paired(a: dict, b: dict) -> str:
    if a["task_ids"] != b["task_ids"]:
        raise RuntimeError("the runs evaluated different held-out tasks; compare runs of the same world")
    d = paired_difference(a["task_rewards"], b["task_rewards"])
    low, high = d["ci"]
    return (f"{d['mean_difference']:+.3f} +- {d['sem']:.3f} (95% CI [{low:+.3f}, {high:+.3f}], p = "
            f"{d['p_paired_t']:.2g}; {d['wins']} better, {d['losses']} worse, {d['ties']} equal)")


def report(root: Path, names: list[str]) -> str:
    learn_rows, step_rows, finals = [], [], {}
    for name in names:
        stage = RUNS[name][1]
        workdir = root / _slug(name)
        evals = _records(workdir / stage / "evals.jsonl")
        own = heldout_summary(evals)
        paired, finals[name] = own["paired"], evals[-1]
        learn_rows.append([name, len(evals[-1]["task_ids"]), f"{paired['start_mean']:.3f}",
                           f"{paired['candidate_mean']:.3f} +- {evals[-1]['reward_sem']:.3f}",
                           _paired(evals[0], evals[-1]),
                           f"{own['all_effects_pass']['start']:.3f} -> {own['all_effects_pass']['end']:.3f}"])
        all_records = _records(workdir / stage / f"{stage}_metrics.jsonl")
        records = _without_compiles(all_records)
        if not records:
            raise RuntimeError(f"{workdir}: every step compiled something; raise --steps")
        step_rows.append(_step_row(name, records, all_records))
    learning = markdown_table(["run", "held-out tasks", "warm start reward", "final reward +- sem",
                               "final - warm start (paired)", "all-effects pass"], learn_rows)
    steps = markdown_table(["run", "steps (without compiles)", "wall s / step", "barrier wait s / step",
                            "within-group wait s", "episode length, mean (median min-max of a batch)",
                            "learner idle", "rollout idle", "all steps, min"], step_rows)
    pairs = [("SAO sync", "group sync"), ("SAO async", "group sync"), ("SAO async", "SAO sync")]
    across = "\n".join(f"- {a} - {b}: {_paired(finals[b], finals[a])}" for a, b in pairs
                        if a in finals and b in finals)
    body = f"{learning}\n\n**Final held-out reward, task by task:**\n{across}\n\n{steps}"
    print(body, flush=True)
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="/tmp/sao_vs_group", help="the runs' workdirs and logs")
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (default 20)")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="which runs, comma-separated; the first trains the warm start (default: all three)")
    parser.add_argument("--eval-tasks", type=int, default=128, help="held-out tasks (default 128, as the demos)")
    parser.add_argument("--report", action="store_true", help="run nothing: report the --runs already in --root")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    root = Path(args.root)
    names = args.runs.split(",")
    if not args.report:
        unknown = set(names) - set(RUNS)
        if unknown:
            parser.error(f"--runs: unknown runs {sorted(unknown)}; choose from {list(RUNS)}")
        first, *others = names
        for name in names:
            shutil.rmtree(root / _slug(name), ignore_errors=True)
        _run(first, root, args.steps, args.eval_tasks)
        for name in others:  # from the first run's warm start: the same weights
            _copy_warm_start(root / _slug(first), root / _slug(name))
            _run(name, root, args.steps, args.eval_tasks)
    body = report(root, names)
    if not args.no_write:
        write_section(f"sao_vs_group_{args.steps}", f"SAO against group-baseline RL: {args.steps} steps on the tiny "
                      f"enterprise world ({', '.join(names)})", body,
                      "python -m mercury_jax.bench.sao_vs_group " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
