"""Asynchronous SAO measured on this machine: does it learn across hosts, and what does it save over sync mode?

    python -m mercury_jax.bench.async_sao learning   # the tiny demo async on 1 process and on 2 (released layout)
    python -m mercury_jax.bench.async_sao timing     # sync vs async, the same config and warm start, one process

Both use `mercury_jax/bench/async_sao_config.py` (the tiny SAO demo over 8 devices: rollout 4 as two replicas,
actor 2, critic 2) and write their section of BENCHMARKS.md (`--no-write`: print only).

learning: the whole demo (SFT warm start, `--steps` SAO steps, held-out evaluations of the same 128 tasks with the
same sampling seeds) as 1 process of 8 devices, then as 2 processes of 4 in the `consecutive` layout (rollout on
process 0, actor and critic on process 1) from the first run's warm start (copied: the same weights; an SFT on
another number of devices per process rounds differently and ends elsewhere); `--together` starts the second run as
soon as the warm start exists, when the wall times do not matter. Each run's final held-out reward is compared with
its own warm start and the 2-process run's with the 1-process run's, task by task
(`evaluation.stats.paired_difference`): async sampling depends on timing, so the two runs are two draws of the same
training, and the question is whether their difference is within the noise.

timing: `--steps` SAO steps in sync mode, then in async mode, each from the warm start of a `learning` run (its
`sft` stage copied in; without one, a run of its own), on one process. Per step: the wall time; the learner's idle
fraction (the step's time spent waiting for its batch, `rollout_s` / step time); the rollout's idle fraction (1 -
the engine's busy seconds in decode chunks and prefills / step time; `Rollouts.usage`); the slot occupancy of the
decode chunks; and the spread of the batch's episode lengths (action tokens), which a sync batch waits out. Steps
that compiled (a padded batch length new to the critic, or to the actor) are left out of the means. On one machine
the rollout and the learner share its cores, so async overlaps them only as far as the CPU allows; on a pod they
have chips of their own.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from mercury_jax.bench.report import markdown_table, write_section
from mercury_jax.evaluation.heldout import heldout_summary
from mercury_jax.evaluation.stats import paired_difference
from tests import local_processes  # the tests' launcher of `main` as N processes (run from a checkout)

CONFIG = "mercury_jax/bench/async_sao_config.py"
RUN_TIMEOUT_S = 4 * 3600
LEARNING_RUNS = {"1 process": (1, 8), "2 processes (consecutive)": (2, 4)}  # name: (processes, devices a process)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _start(mode: str, workdir: Path, logs: Path, processes: int, devices: int, overrides: list[str]):
    args = ["--config", f"{CONFIG}:{mode}", "--workdir", str(workdir), *overrides]
    return local_processes.launch(args, logs=logs, processes=processes, devices=devices, name=workdir.name)


def _run(mode: str, workdir: Path, logs: Path, processes: int, devices: int, overrides: list[str]) -> float:
    """One run to its end (resumed where an earlier one stopped); returns its wall seconds."""
    print(f"{workdir.name}: {mode}, {processes} process(es) x {devices} devices (logs: {logs})", flush=True)
    start = time.perf_counter()
    local_processes.wait(_start(mode, workdir, logs, processes, devices, overrides), logs=logs,
                         timeout_s=RUN_TIMEOUT_S)
    return time.perf_counter() - start


def _accounting(workdir: Path) -> dict:
    batches = _records(workdir / "sao" / "batches.jsonl")
    trained = [e for b in batches for e in b["episode_ids"]]
    lags = [lag for b in batches for lag in b["policy_lag"]]
    return {"trained": len(trained), "unique": len(set(trained)) == len(trained), "max_lag": max(lags, default=0),
            "dropped_stale": sum(b["dropped_stale"] for b in batches)}


def learning(args) -> str:
    root = Path(args.root)
    if not args.report:
        for name in LEARNING_RUNS:
            shutil.rmtree(root / _slug(name), ignore_errors=True)
    overrides = [f"--config.sao.steps={args.steps}"]
    names = list(LEARNING_RUNS)
    walls = {}
    if args.report:
        walls = {name: _wall_from_logs(root / _slug(name)) for name in names}
    else:
        first, second = names
        start = time.perf_counter()
        procs = _start("async", root / _slug(first), root / "logs", *LEARNING_RUNS[first], overrides)
        if not args.together:
            local_processes.wait(procs, logs=root / "logs", timeout_s=RUN_TIMEOUT_S)
            walls[first] = time.perf_counter() - start
        # the second run starts from the first one's warm start: an SFT stage run on a process with another number of
        # devices rounds differently, and 200 steps at lr 1e-3 amplify that into a different policy
        local_processes.wait(procs, logs=root / "logs", timeout_s=RUN_TIMEOUT_S,
                             until=lambda: (root / _slug(first) / "sao").exists())  # the SFT stage is closed
        _copy_warm_start(root / _slug(first), root / _slug(second))
        start_second = time.perf_counter()
        local_processes.wait(_start("async", root / _slug(second), root / "logs", *LEARNING_RUNS[second], overrides),
                             logs=root / "logs", timeout_s=RUN_TIMEOUT_S)
        walls[second] = time.perf_counter() - start_second
        if first not in walls:
            local_processes.wait(procs, logs=root / "logs", timeout_s=RUN_TIMEOUT_S)
            walls[first] = time.perf_counter() - start

    rows, evals = [], {}
    for name in names:
        workdir = root / _slug(name)
        evals[name] = _records(workdir / "sao" / "evals.jsonl")
        own = heldout_summary(evals[name])
        acct = _accounting(workdir)
        paired = own["paired"]
        rows.append([name, len(evals[name][-1]["task_ids"]), f"{paired['start_mean']:.3f}",
                     f"{paired['candidate_mean']:.3f} +- {evals[name][-1]['reward_sem']:.3f}",
                     f"{paired['mean_difference']:+.3f} +- {paired['sem']:.3f} (p = {paired['p_paired_t']:.2g})",
                     f"{own['all_effects_pass']['start']:.3f} -> {own['all_effects_pass']['end']:.3f}",
                     f"{acct['trained']} ({'each once' if acct['unique'] else 'REPEATS'})", acct["max_lag"],
                     acct["dropped_stale"], f"{walls[name] / 60:.1f}"])
    table = markdown_table(["run (async)", "held-out tasks", "warm start reward", "final reward +- sem",
                            "final - warm start (paired)", "all-effects pass", "episodes trained",
                            "max policy lag", "dropped stale", "wall min"], rows)
    one, two = (evals[name][-1] for name in names)
    if one["task_ids"] != two["task_ids"]:
        raise RuntimeError("the two runs evaluated different held-out tasks; compare runs of one config")
    diff = paired_difference(one["task_rewards"], two["task_rewards"])
    low, high = diff["ci"]
    verdict = ("within the noise" if low <= 0 <= high else "outside the 95% interval")
    body = (f"{table}\n\n**2 processes - 1 process, final held-out reward, task by task:** "
            f"{diff['mean_difference']:+.3f} +- {diff['sem']:.3f} (sem), 95% CI [{low:+.3f}, {high:+.3f}], paired t "
            f"p = {diff['p_paired_t']:.2g}; {diff['wins']} tasks better, {diff['losses']} worse, {diff['ties']} "
            f"equal over {diff['num_tasks']} tasks: {verdict}.")
    print(body, flush=True)
    return body


def _wall_from_logs(workdir: Path) -> float:
    """A finished run's wall seconds, from its workdir's files: config.json (written at start-up) to evals.jsonl
    (written last)."""
    return (workdir / "sao" / "evals.jsonl").stat().st_mtime - (workdir / "config.json").stat().st_mtime


def _slug(name: str) -> str:
    return name.split(" (")[0].replace(" ", "-")


def _copy_warm_start(source: Path, workdir: Path) -> None:
    """The finished SFT stage of `source` (and its tokenizer): the run restores it instead of training it again."""
    workdir.mkdir(parents=True)
    for part in ("sft", "tokenizer", "sft_summary.json"):
        if (source / part).is_dir():
            shutil.copytree(source / part, workdir / part)
        elif (source / part).exists():
            shutil.copy2(source / part, workdir / part)


def _without_compiles(records: list[dict], workdir: Path) -> list[dict]:
    """The steps that compiled nothing: each step whose padded batch length is new in the run compiles the critic's
    programs for it, and after the critic-only steps the actor's too."""
    config = json.loads((workdir / "config.json").read_text())
    critic_only = config["sao"]["critic_only_steps"]
    seen, kept = set(), []
    for record in records:
        programs = (record["batch_length"], record["step"] > critic_only)
        if programs in seen:
            kept.append(record)
        seen.add(programs)
    return kept


def timing(args) -> str:
    root = Path(args.root)
    warm = root / _slug(next(iter(LEARNING_RUNS)))
    overrides = [f"--config.sao.steps={args.steps}", "--config.sao.eval_every=0", "--config.checkpoint.every=0",
                 "--config.world.num_eval_tasks=8"]  # the evaluations before and after are not timed
    results = {}
    for mode in ("sync", "async"):
        workdir = root / f"timing-{mode}"
        if args.report:
            wall = (workdir / "sao" / "sao_metrics.jsonl").stat().st_mtime - (workdir / "config.json").stat().st_mtime
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            if (warm / "sft").is_dir():
                _copy_warm_start(warm, workdir)
            wall = _run(mode, workdir, root / "logs", 1, 8, overrides)
        records = _without_compiles(_records(workdir / "sao" / "sao_metrics.jsonl"), workdir)
        if not records:
            raise RuntimeError(f"{workdir}: every step compiled something; raise --steps")
        results[mode] = (records, wall)

    rows = []
    for mode, (records, wall) in results.items():
        step = np.array([r["step_time_s"] for r in records])
        waiting = np.array([r["rollout_s"] for r in records])
        busy = np.array([r["rollout_busy_s"] for r in records])
        lengths_min = [r["response_length_min"] for r in records]
        lengths_max = [r["response_length_max"] for r in records]
        rows.append([mode, len(records), f"{step.mean():.2f}", f"{waiting.sum() / step.sum():.0%}",
                     f"{1 - busy.sum() / step.sum():.0%}",
                     f"{np.mean([r['slot_occupancy'] for r in records]):.0%}",
                     f"{np.mean([r['response_length'] for r in records]):.0f} ({int(np.median(lengths_min))}-"
                     f"{int(np.median(lengths_max))})",
                     f"{np.mean([r['staleness_mean'] for r in records]):.2f}", f"{wall / 60:.1f}"])
    table = markdown_table(["mode", "steps (without compiles)", "wall s / step", "learner idle", "rollout idle",
                            "slot occupancy", "episode length, mean (median min-max of a batch)",
                            "policy lag, mean", "run wall min"], rows)
    sync_step = np.mean([r["step_time_s"] for r in results["sync"][0]])
    async_step = np.mean([r["step_time_s"] for r in results["async"][0]])
    body = (f"{table}\n\nAsync / sync wall time per step: **{async_step / sync_step:.2f}** "
            f"({async_step:.2f} s / {sync_step:.2f} s).")
    print(body, flush=True)
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("learning", "timing"))
    parser.add_argument("--root", default="/tmp/async_sao", help="the runs' workdirs and logs")
    parser.add_argument("--steps", type=int, default=0,
                        help="SAO steps (default: learning 20, the demo's first evaluation; timing 16)")
    parser.add_argument("--together", action="store_true", help="learning: both runs at once")
    parser.add_argument("--report", action="store_true", help="run nothing: report the runs already in --root")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.what == "learning" else 16)
    body = learning(args) if args.what == "learning" else timing(args)
    if not args.no_write:
        title = ("Async SAO across hosts: the tiny demo on 1 and 2 processes" if args.what == "learning" else
                 "Async vs sync SAO on one machine: the tiny config side by side")
        write_section(f"async_sao_{args.what}", title, body,
                      "python -m mercury_jax.bench.async_sao " + shlex.join(sys.argv[1:]))


if __name__ == "__main__":
    main()
