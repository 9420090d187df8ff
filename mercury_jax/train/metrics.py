"""Metrics: a JSONL line and TensorBoard scalars per step, 20-step window means, a progress line with ETA,
and PNG plots of the curves at the end."""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time

import numpy as np

from mercury_jax.parallel.distributed import is_primary
from mercury_jax.runs.resume import read_jsonl, write_jsonl
from mercury_jax.runs.rundir import StageDir, append_line, as_path


class MetricsLogger:
    def __init__(self, stage: StageDir, *, total_steps: int, window: int = 20, tensorboard: bool = True,
                 stream=sys.stdout):
        self.stage, self.path, self.name = stage.make(), stage.metrics, stage.name
        self.total_steps, self.window, self.stream = total_steps, window, stream
        self.history: list[dict] = []
        if self.path.exists():  # a resumed run keeps its earlier curve (a torn last line is dropped)
            self.history = read_jsonl(self.path)
        self._writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # noqa: PLC0415  (imports TensorFlow-style protobufs: only when asked)
            self._writer = SummaryWriter(os.fspath(stage.tensorboard))
        self._start = time.perf_counter()
        self._start_step: int | None = None

    def truncate(self, last_step: int) -> None:
        """Drop records after `last_step` (a resumed run replays those steps)."""
        self.history = [r for r in self.history if r["step"] <= last_step]
        write_jsonl(self.path, self.history)

    def log(self, step: int, metrics: dict, *, progress_keys: tuple[str, ...] = ()) -> dict:
        record = {"step": step, **{k: _scalar(v) for k, v in metrics.items()}}
        window = [r for r in self.history if r["step"] > step - self.window] + [record]
        for key in progress_keys:
            values = [r[key] for r in window if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if values:
                record[f"window/{key}"] = float(np.mean(values))
        self.history.append(record)
        append_line(self.path, json.dumps(record))
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"{self.name}/{key}", value, step)
        self._progress(step, record, progress_keys)
        return record

    def _progress(self, step: int, record: dict, keys: tuple[str, ...]) -> None:
        if self._start_step is None:
            self._start_step, self._start = step - 1, time.perf_counter()
        done = step - self._start_step
        elapsed = time.perf_counter() - self._start
        remaining = (self.total_steps - step) * elapsed / max(done, 1)
        shown = " ".join(f"{k}={record[k]:.4g}" for k in keys if isinstance(record.get(k), (int, float)))
        print(f"[{self.name}] step {step}/{self.total_steps} {shown} | {elapsed:.0f}s elapsed, ETA {remaining:.0f}s",
              file=self.stream, flush=True)

    def plot(self, keys: list[str]):
        """One PNG with a panel per key (raw per step and the window mean)."""
        keys = [k for k in keys if any(k in r for r in self.history)]
        if not keys:
            return None
        import matplotlib  # noqa: PLC0415  (~0.5 s to import; only plotting needs it)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415  (after the backend is chosen)

        fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), sharex=True, squeeze=False)
        for ax, key in zip(axes[:, 0], keys):
            points = [(r["step"], r[key]) for r in self.history if isinstance(r.get(key), (int, float))]
            ax.plot(*zip(*points), ".", alpha=0.4, label=key)
            smooth = [(r["step"], r[f"window/{key}"]) for r in self.history if f"window/{key}" in r]
            if smooth:
                ax.plot(*zip(*smooth), "-", label=f"{self.window}-step mean")
            ax.set_ylabel(key, fontsize=8)
            ax.legend(fontsize=7, loc="best")
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        return save_figure(fig, self.stage.curves)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def plot_evaluations(evaluations: list[dict], path: str | os.PathLike, *, title: str = "held-out evaluations"):
    """One PNG of held-out evaluations over training: mean reward +- 1 sem and the all-effects pass rate per step
    (records with `step`, `reward`, `reward_sem`, `all_effects_pass`)."""
    import matplotlib  # noqa: PLC0415  (~0.5 s to import; only plotting needs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  (after the backend is chosen)

    steps = [e["step"] for e in evaluations]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.errorbar(steps, [e["reward"] for e in evaluations], yerr=[e["reward_sem"] for e in evaluations], fmt="o-",
                capsize=3, label="reward (mean +- sem)")
    ax.plot(steps, [e["all_effects_pass"] for e in evaluations], "s--", label="all-effects pass rate")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig, path: str | os.PathLike):
    """Write a matplotlib figure as PNG to a local path or a URI (through memory), close it; returns the path."""
    import matplotlib.pyplot as plt  # noqa: PLC0415  (only plotting needs it)

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    path = as_path(path)
    if is_primary():  # one process writes a run's files
        path.write_bytes(buffer.getvalue())
    return path


def _scalar(value):
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        value = value.item()
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    return value
