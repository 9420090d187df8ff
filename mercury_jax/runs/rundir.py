"""The run directory: the one place that knows where a run keeps what (docs/DESIGN.md "Run directory").

    WORKDIR/config.json              the run's config (export and the sweep rebuild the model from it)
    WORKDIR/environment.json         Python, backend and package versions of every start
    WORKDIR/tokenizer/               the SentencePiece model a tiny run trains (Qwen3.5 runs ship none)
    WORKDIR/sft_summary.json         the warm start's final loss
    WORKDIR/sft_corpus.json          the SFT corpus's files, sizes and times at the start (a resume compares them)
    WORKDIR/STAGE/checkpoints/STEP   Orbax checkpoints of a stage (a pipeline's name: config/registry.py)
    WORKDIR/STAGE/STAGE_metrics.jsonl  one line per logged step; STAGE_curves.png its plot
    WORKDIR/STAGE/tensorboard/STAGE  TensorBoard scalars (local run directories only)
    WORKDIR/sao/evals.jsonl          held-out evaluations (eval_summary.json, sao_heldout.png)
    WORKDIR/sao/batches.jsonl        each step's episode ids with their policy lag, and the episodes dropped
    WORKDIR/grpo/samples.jsonl       every continuation with its verdict; pivots.jsonl the pivot dataset;
                                     summary.json the first and last records
    WORKDIR/sweep/                   the checkpoint sweep's outcomes, table and plot

Paths are `etils.epath` paths, so a root given as `gs://bucket/run` (or any URI epath knows) stays a URI: a
`pathlib.Path` would turn it into a local folder `gs:/bucket/run`. `file:///abs/path` is taken as the local path.
Remote files cannot be appended to; `append_line` rewrites them (the JSONL logs are small).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import ml_collections
from etils import epath

from mercury_jax.config.registry import stages
from mercury_jax.parallel.distributed import is_primary
from mercury_jax.runs.checkpoint_roles import is_arrays_item
from mercury_jax.data.uris import check_remote


def checkpoint_steps(checkpoint_dir: str | os.PathLike) -> list[int]:
    """The committed checkpoint steps of an Orbax checkpoint directory, ascending: Orbax writes a step under a
    temporary name and renames it to the bare number when it is complete; a step counts once it holds an array item
    (`checkpoint_roles.is_arrays_item`)."""
    checkpoint_dir = checkpoint_dir if isinstance(checkpoint_dir, epath.Path) else as_path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoint_dir.iterdir()
                  if p.name.isdigit() and any(is_arrays_item(q.name) for q in p.iterdir()))


def as_path(location: str | os.PathLike) -> epath.Path:
    """An epath for a local path, a `file://` URI (taken as the local path) or a remote URI (`gs://...`; a
    `RemotePathError` when it holds `.` or `..` segments: `uris.check_remote`; whether its filesystem package is
    installed is checked where a run directory is first read or made: `main`, `RunReader`)."""
    text = os.fspath(location)
    check_remote(text, "run directory", filesystem=False)
    if text.startswith("file://"):
        text = text[len("file://"):]
        if not text.startswith("/"):
            raise ValueError(f"{location!r}: a file URI needs an absolute path, file:///abs/path")
    return epath.Path(text)


def is_local(path: epath.Path) -> bool:
    return isinstance(path, Path) or "://" not in os.fspath(path)


def append_line(path: epath.Path, line: str) -> None:
    """Append `line` (and a newline) to a text file (process 0 only); remote files are read and rewritten."""
    if not is_primary():
        return
    if is_local(path):
        with open(os.fspath(path), "a") as f:
            f.write(line + "\n")
    else:
        path.write_text((path.read_text() if path.exists() else "") + line + "\n")


def write_text(path: epath.Path, text: str) -> None:
    """`path.write_text(text)` by process 0 only: one process writes a run's files (docs/DESIGN.md "Multi-host")."""
    if is_primary():
        path.write_text(text)


def write_atomically(path: epath.Path, text: str) -> None:
    """Replace a text file through a temporary file and a rename (process 0 only): a kill leaves the old file or
    the new one."""
    if not is_primary():
        return
    staging = path.parent / (path.name + ".tmp")
    staging.write_text(text)
    staging.replace(path)


class RunDir:
    """A run's directory (see the module docstring for the layout); `root` is a local path or a URI."""

    def __init__(self, root: str | os.PathLike | RunDir):
        self.root = root.root if isinstance(root, RunDir) else as_path(root)
        self.local = is_local(self.root)
        if self.local:
            self.root = epath.Path(os.path.abspath(os.fspath(self.root)))
        self.config, self.environment = self.root / "config.json", self.root / "environment.json"
        self.tokenizer, self.sft_summary, self.sweep = (self.root / "tokenizer", self.root / "sft_summary.json",
                                                        self.root / "sweep")
        self.corpus_fingerprint = self.root / "sft_corpus.json"

    def __repr__(self) -> str:
        return f"RunDir({os.fspath(self.root)!r})"

    def make(self) -> RunDir:
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    def stage(self, name: str) -> StageDir:
        if name not in stages():
            raise ValueError(f"stage {name!r} is not one of {stages()}")
        return StageDir(self.root / name, name)

    def write_config(self, config: ml_collections.ConfigDict) -> epath.Path:
        """The run's config as JSON (process 0 only): export and the sweep rebuild the run's model from it."""
        if is_primary():  # replaced whole: the other processes of a resumed run read it meanwhile (resume.py)
            self.make()
            write_atomically(self.config, config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
        return self.config

    def read_config(self) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(json.loads(self.config.read_text()))

    def committed_checkpoints(self) -> dict[str, list[int]]:
        """The committed checkpoint steps (`checkpoint_steps`) of each stage that has any, from the files alone."""
        found = {}
        for name in stages():
            steps = checkpoint_steps(self.root / name / "checkpoints")
            if steps:
                found[name] = steps
        return found

    def describe_checkpoints(self) -> str:
        """One line on the newest committed checkpoint of each stage, for messages about a stopped run."""
        try:
            found = self.committed_checkpoints()
        except OSError as error:
            return f"the checkpoints under {os.fspath(self.root)} could not be listed ({error})"
        if not found:
            return f"no checkpoint is committed under {os.fspath(self.root)} yet"
        return "last committed checkpoints: " + ", ".join(
            f"{name} step {steps[-1]} ({os.fspath(self.root / name / 'checkpoints' / str(steps[-1]))})"
            for name, steps in found.items())


class StageDir:
    """One stage's folder: checkpoints, metrics, plots and the stage's own logs."""

    def __init__(self, path: epath.Path, name: str):
        self.path, self.name = path, name
        self.checkpoints, self.tensorboard = path / "checkpoints", path / "tensorboard" / name
        self.metrics, self.curves = path / f"{name}_metrics.jsonl", path / f"{name}_curves.png"
        self.evals, self.eval_summary, self.heldout_plot = (path / "evals.jsonl", path / "eval_summary.json",
                                                            path / f"{name}_heldout.png")
        self.samples, self.pivots, self.summary = path / "samples.jsonl", path / "pivots.jsonl", path / "summary.json"
        self.batches = path / "batches.jsonl"

    def make(self) -> StageDir:
        self.path.mkdir(parents=True, exist_ok=True)
        return self
