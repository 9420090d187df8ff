"""The one training loop of every stage (docs/DESIGN.md "Training wing"): SFT, SAO and pivot GRPO are algorithm
objects that say what a step does; the loop owns restore, publish, logging, evaluation, checkpoints, preemption.

    restore the newest checkpoint that restores and republish it (or save step 0 first: `Cadence.save_initial`)
    for step in start+1 .. steps:
        result = algorithm.step(step, version=, guard=)     policy_updated -> version += 1, rollouts.publish
        log every `log_every` steps, the first and last, and skipped ones; evaluate every `eval_every` steps;
        checkpoint every `checkpoint_every` steps, the last one, and on a SIGTERM (then exit 143)
    final evaluation, algorithm.finish(history, evaluations), curves plot

A resume drops the log rows written after its checkpoint (those steps are replayed). A non-finite update raises
`NonFiniteError` through the guard before the step is logged or saved (or is skipped: `guards.py`). On any
exception the rollout side is stopped and the last good checkpoint still gets committed. A damaged newer checkpoint
is skipped on resume, and a failed save stops the run with `CheckpointSaveError` (`checkpoints.py`).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Protocol

from mercury_jax.parallel.distributed import is_primary
from mercury_jax.runs import preemption
from mercury_jax.runs.checkpoints import Checkpointer, checkpoint_layout
from mercury_jax.runs.resume import read_jsonl, truncate_jsonl
from mercury_jax.runs.rundir import StageDir, append_line, is_local, write_text
from mercury_jax.train.guards import NonFiniteGuard
from mercury_jax.train.metrics import MetricsLogger


@dataclasses.dataclass
class StepResult:
    metrics: dict
    policy_updated: bool = False  # new weights for the rollout side (the version counts these)
    applied: bool = True          # False: a non-finite update was skipped (train.nonfinite="skip")


class Algorithm(Protocol):
    """What a stage implements; optional: `evaluate(label)` with `final_label`, `finish(history, evaluations)`,
    `logs` (its own JSONL files, truncated on resume), `data_stream` (a data iterator in grain's checkpoint protocol,
    e.g. `data/row_stream.RowStream`: its position is saved in every checkpoint and restored with it)."""
    stage: str
    steps: int
    progress_keys: tuple[str, ...]
    plot_keys: tuple[str, ...]

    def arrays(self) -> Any: ...                       # what a checkpoint holds
    def meta(self) -> dict: ...                        # data-order state saved beside the arrays
    def restore(self, arrays: Any, meta: dict) -> None: ...
    def step(self, step: int, *, version: int, guard: NonFiniteGuard) -> StepResult: ...
    def policy(self): ...                              # the model whose weights the rollout side samples with


@dataclasses.dataclass(frozen=True)
class Cadence:
    checkpoint_every: int
    keep: int
    async_save: bool = True
    eval_every: int = 0        # 0: evaluate only before the first and after the last step
    log_every: int = 1
    log_window: int = 20
    save_initial: bool = False  # checkpoint step 0 (the starting policy) before the first update

    @classmethod
    def from_config(cls, checkpoint, **kwargs) -> Cadence:
        return cls(checkpoint_every=checkpoint.every, keep=checkpoint.keep, async_save=checkpoint.async_save,
                   **kwargs)


def run_loop(algorithm: Algorithm, stage: StageDir, cadence: Cadence, *, train_cfg=None, rollouts=None,
             make_checkpointer=Checkpointer) -> list[dict]:
    """Run `algorithm` from its stage's latest checkpoint to `algorithm.steps`; returns the metric history."""
    stage.make()
    name = algorithm.stage
    checkpointer = make_checkpointer(stage.checkpoints, save_every=cadence.checkpoint_every, keep=cadence.keep,
                                     async_save=cadence.async_save, layout=checkpoint_layout(algorithm.arrays()))
    start, version = _restore(algorithm, checkpointer, cadence, rollouts)
    logger = _open_logs(algorithm, stage, cadence, start)
    evaluates = hasattr(algorithm, "evaluate")
    guard = NonFiniteGuard.from_config(train_cfg, name=name, history=logger.history)
    try:
        for step in range(start + 1, algorithm.steps + 1):
            t0 = time.perf_counter()
            result = algorithm.step(step, version=version, guard=guard)
            if result.policy_updated:
                version += 1
                if rollouts is not None:
                    rollouts.publish(algorithm.policy(), version)
            seconds = time.perf_counter() - t0
            last = step == algorithm.steps
            if step % cadence.log_every == 0 or last or step == start + 1 or not result.applied:
                logger.log(step, _step_metrics(result, seconds, guard, version if rollouts is not None else None),
                           progress_keys=algorithm.progress_keys)
            if evaluates and cadence.eval_every and step % cadence.eval_every == 0 and not last:
                append_line(stage.evals, json.dumps({"step": step, **algorithm.evaluate(f"step {step}")}))
            preemption.poll(step)  # several processes: the same step everywhere, whichever host got the signal
            if checkpointer.should_save(step, last=last):
                _save(checkpointer, algorithm, step, version, rollouts)
            preemption.exit_if_requested(step, name, checkpointer)
    except BaseException:  # a non-finite step, a preemption, a failure: nothing may outlive the loop
        if rollouts is not None:
            rollouts.stop_after_error()
        checkpointer.close_after_error()  # the last good save still gets committed
        _close_data(algorithm)
        raise
    if rollouts is not None:
        rollouts.stop()
    checkpointer.close()
    _close_data(algorithm)
    evaluations = _final_evaluations(algorithm, stage) if evaluates else []
    if hasattr(algorithm, "finish"):
        algorithm.finish(logger.history, evaluations)
    logger.plot(list(algorithm.plot_keys))
    logger.close()
    return logger.history


def _close_data(algorithm: Algorithm) -> None:
    """Stop the algorithm's data workers (grain's, SFT), after the last checkpoint has saved their position."""
    close = getattr(getattr(algorithm, "data_stream", None), "close", None)
    if close is not None:
        close()


def _restore(algorithm: Algorithm, checkpointer, cadence: Cadence, rollouts) -> tuple[int, int]:
    """(start step, policy version) from the newest checkpoint that restores, its policy republished; with none,
    (0, 0), after saving step 0 when `cadence.save_initial`."""
    start, version = 0, 0
    data = getattr(algorithm, "data_stream", None)
    # skips (and moves aside) damaged newer steps
    restored = checkpointer.restore_latest(algorithm.arrays(), **({"data": data} if data is not None else {}))
    if restored is not None:
        arrays, meta = restored
        algorithm.restore(arrays, meta)
        start, version = meta["step"], meta.get("version", 0)
        if rollouts is not None:
            rollouts.publish(algorithm.policy(), version)
        data_restored = getattr(checkpointer, "data_restored", False)
        print(f"[{algorithm.stage}] resumed from step {start} ({_describe(meta, data_restored)})", flush=True)
    elif cadence.save_initial:
        _save(checkpointer, algorithm, 0, version, rollouts)
    return start, version


def _open_logs(algorithm: Algorithm, stage: StageDir, cadence: Cadence, start: int) -> MetricsLogger:
    """The metrics logger, with every log's rows after `start` dropped (they are replayed); evaluations after
    `start` dropped too, or on a fresh start the warm start's evaluation written."""
    logger = MetricsLogger(stage, total_steps=algorithm.steps, window=cadence.log_window,
                           tensorboard=is_local(stage.path) and is_primary())
    logger.truncate(start)
    for log in getattr(algorithm, "logs", ()):
        truncate_jsonl(log, start)
    if hasattr(algorithm, "evaluate"):
        if start == 0:
            write_text(stage.evals, json.dumps({"step": 0, **algorithm.evaluate("warm start")}) + "\n")
        else:  # rows after the checkpoint (an evaluation written just before a kill) are replayed
            truncate_jsonl(stage.evals, start)
    return logger


def _step_metrics(result: StepResult, seconds: float, guard: NonFiniteGuard, version: int | None) -> dict:
    """A step's logged row: its metrics with tokens as a rate, the skipped count, the step time and (with a
    rollout side) the policy version."""
    metrics = dict(result.metrics)
    tokens = metrics.pop("tokens", None)
    if tokens is not None:
        metrics["tokens_per_s"] = tokens / seconds
    metrics.update(nonfinite_skipped=guard.skipped, step_time_s=seconds)
    if version is not None:
        metrics["policy_version"] = version
    return metrics


def _final_evaluations(algorithm: Algorithm, stage: StageDir) -> list[dict]:
    """Every evaluation of the stage, the final one run and appended unless a resumed run already wrote it."""
    evaluations = read_jsonl(stage.evals)
    final = algorithm.final_label
    if not any(e["step"] == algorithm.steps and e["label"] == final for e in evaluations):
        evaluations.append({"step": algorithm.steps, **algorithm.evaluate(final)})
        append_line(stage.evals, json.dumps(evaluations[-1]))
    return evaluations


def _save(checkpointer, algorithm: Algorithm, step: int, version: int, rollouts) -> None:
    """Checkpoint `step`: the arrays, the metadata and (a stage with one) the data stream's position now."""
    data = getattr(algorithm, "data_stream", None)
    checkpointer.save(step, algorithm.arrays(), _meta(algorithm, step, version, rollouts),
                      **({"data": data.snapshot()} if data is not None else {}))


def _meta(algorithm: Algorithm, step: int, version: int, rollouts) -> dict:
    meta = {"step": step}
    if rollouts is not None:
        meta["version"] = version
    return {**meta, **algorithm.meta()}


def _describe(meta: dict, data_restored: bool = False) -> str:
    def short(value):  # a section (the async batch state) by its scalars and the sizes of its lists
        if not isinstance(value, dict):
            return value
        return "(" + ", ".join(f"{k} {len(v) if isinstance(v, (list, dict)) else v}" for k, v in value.items()) + ")"
    parts = [f"{k} {short(v)}" for k, v in meta.items() if k != "step"]
    parts += ["the data stream's position"] if data_restored else []
    return ", ".join(parts) or "no data-order state"
