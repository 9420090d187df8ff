"""The training loop (`train/loop.py`) and the run directory (`runs/rundir.py`) with a scripted algorithm: what is
logged, evaluated, checkpointed and published at which step, what a resume replays, what an error leaves behind,
and run directories named by URI."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from etils import epath
from etils.epath import testing as epath_testing

from mercury_jax.runs.resume import read_jsonl
from mercury_jax.runs.rundir import RunDir, append_line, as_path
from mercury_jax.train.guards import NonFiniteError
from mercury_jax.train.loop import Cadence, StepResult, run_loop
from mercury_jax.train.metrics import MetricsLogger


class Counting:
    """An algorithm whose state is one array: step s adds s to it; every `update_every`-th step is a policy update;
    `nan_at` logs a non-finite loss (the guard's business); `fail_at` raises."""
    stage = "sao"
    final_label = "final"
    progress_keys = ("loss",)
    plot_keys = ("loss",)

    def __init__(self, steps: int, *, update_every: int = 1, nan_at: int = -1, fail_at: int = -1):
        self.steps, self.update_every, self.nan_at, self.fail_at = steps, update_every, nan_at, fail_at
        self.total, self.consumed, self.calls, self.evaluated = np.zeros(3, np.float32), 0, [], []
        self.logs = ()

    def arrays(self):
        return {"total": self.total}

    def meta(self):
        return {"consumed": self.consumed}

    def restore(self, arrays, meta):
        self.total, self.consumed = np.asarray(arrays["total"]), meta["consumed"]

    def policy(self):
        return float(self.total[0])

    def step(self, step, *, version, guard):
        if step == self.fail_at:
            raise RuntimeError(f"step {step} failed")
        self.calls.append((step, version))
        loss = float("nan") if step == self.nan_at else 1.0 / step
        applied = guard.check(step, {"loss": loss, "grad_norm": 1.0})
        if applied:
            self.total = self.total + step
            self.consumed += 2
        return StepResult({"loss": loss, "tokens": 10.0}, policy_updated=applied and step % self.update_every == 0,
                          applied=applied)

    def evaluate(self, label):
        self.evaluated.append(label)
        return {"label": label, "value": float(self.total[0])}


class RecordingRollouts:
    def __init__(self):
        self.published, self.stopped, self.stopped_after_error = [], 0, 0

    def publish(self, policy, version):
        self.published.append((version, policy))

    def stop(self):
        self.stopped += 1

    def stop_after_error(self):
        self.stopped_after_error += 1


def cadence(**kwargs):
    return Cadence(**{"checkpoint_every": 2, "keep": 10, "async_save": False, **kwargs})


def _steps(checkpoints) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def test_steps_publish_log_evaluate_and_checkpoint_on_their_cadences(tmp_path):
    stage, algorithm, rollouts = RunDir(tmp_path).stage("sao"), Counting(5, update_every=2), RecordingRollouts()
    history = run_loop(algorithm, stage, cadence(eval_every=2, log_every=2), rollouts=rollouts)
    assert algorithm.calls == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]  # the version counts policy updates
    assert rollouts.published == [(1, 3.0), (2, 10.0)] and rollouts.stopped == 1
    assert [r["step"] for r in history] == [1, 2, 4, 5]  # every 2 steps, plus the first and the last
    assert [r["policy_version"] for r in history] == [0, 1, 2, 2]
    assert history[0]["tokens_per_s"] == pytest.approx(10.0 / history[0]["step_time_s"])
    assert "tokens" not in history[0]
    # evaluations: before the first step, every 2 steps but the last, and the final one
    assert [(r["step"], r["label"]) for r in read_jsonl(stage.evals)] == [
        (0, "warm start"), (2, "step 2"), (4, "step 4"), (5, "final")]
    assert _steps(stage.checkpoints) == [2, 4, 5]
    meta = json.loads((stage.checkpoints / "4" / "meta" / "metadata").read_text())
    assert meta == {"step": 4, "version": 2, "consumed": 8}
    assert stage.curves.exists() and stage.metrics.exists()


def test_a_resume_restores_state_drops_later_rows_and_republishes(tmp_path):
    stage = RunDir(tmp_path).stage("sao")
    with pytest.raises(RuntimeError, match="step 4 failed"):
        run_loop(Counting(6, fail_at=4), stage, cadence(eval_every=1), rollouts=RecordingRollouts())
    # an evaluation written after the last checkpoint (step 2) is a row the resumed run writes again
    append_line(stage.evals, json.dumps({"step": 3, "label": "step 3", "value": 6.0}))
    assert [r["step"] for r in read_jsonl(stage.metrics)] == [1, 2, 3]
    algorithm, rollouts = Counting(6), RecordingRollouts()
    history = run_loop(algorithm, stage, cadence(eval_every=1), rollouts=rollouts)
    assert algorithm.calls[0] == (3, 2) and rollouts.published[0] == (2, 3.0)  # restored state, republished
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_jsonl(stage.evals)] == [0, 1, 2, 3, 4, 5, 6]
    uninterrupted = Counting(6)
    run_loop(uninterrupted, RunDir(tmp_path / "fresh").stage("sao"), cadence(eval_every=1),
             rollouts=RecordingRollouts())
    np.testing.assert_array_equal(algorithm.total, uninterrupted.total)
    assert algorithm.consumed == uninterrupted.consumed == 12


def test_an_error_stops_the_rollouts_and_keeps_the_last_checkpoint(tmp_path):
    stage, rollouts = RunDir(tmp_path).stage("sao"), RecordingRollouts()
    with pytest.raises(NonFiniteError, match=r"\[sao\] step 3"):
        run_loop(Counting(5, nan_at=3), stage, cadence(), rollouts=rollouts)
    assert rollouts.stopped_after_error == 1 and rollouts.stopped == 0
    assert _steps(stage.checkpoints) == [2]
    assert [r["step"] for r in read_jsonl(stage.metrics)] == [1, 2]


def test_skipped_updates_are_logged_and_counted(tmp_path):
    train = {"nonfinite": "skip", "max_skipped": 1}
    history = run_loop(Counting(4, nan_at=2), RunDir(tmp_path).stage("sao"), cadence(log_every=10),
                       train_cfg=_config(train), rollouts=RecordingRollouts())
    # logged: the first step, the skipped one (whatever the cadence) and the last
    assert [(r["step"], r["nonfinite_skipped"]) for r in history] == [(1, 0), (2, 1), (4, 1)]


def _config(values: dict):
    import ml_collections
    return ml_collections.ConfigDict(values)


# ------------------------------------------------------------------------------------------------ run directory
def test_uris_name_run_directories():
    assert os.fspath(as_path("file:///tmp/run")) == "/tmp/run"
    with pytest.raises(ValueError, match="file:///abs/path"):
        as_path("file://relative/run")
    remote = RunDir("gs://bucket/runs/sao")
    assert not remote.local
    # a pathlib.Path would collapse the scheme's // into a local folder "gs:/bucket"
    assert os.fspath(remote.stage("sao").checkpoints) == "gs://bucket/runs/sao/sao/checkpoints"
    assert os.fspath(remote.config) == "gs://bucket/runs/sao/config.json"
    assert RunDir("runs/x").root.is_absolute()  # Orbax resolves nothing relative
    with pytest.raises(ValueError, match="stage 'ppo' is not one of"):
        remote.stage("ppo")


def test_logs_of_a_remote_run_directory_are_rewritten_not_appended(tmp_path):
    """gs:// files cannot be opened for appending: with epath's backend mocked onto local files (open, exists...),
    the metrics logger and `append_line` must only read and write whole files."""
    modes = []

    def local_open(original, path, mode="r"):
        modes.append(mode)
        return original(_local(tmp_path, path), mode)

    def on_local(name):
        return lambda original, path, *args, **kwargs: original(_local(tmp_path, path), *args, **kwargs)

    with epath_testing.mock_epath(open=local_open, exists=on_local("exists"), makedirs=on_local("makedirs"),
                                  mkdir=on_local("mkdir"), isdir=on_local("isdir"), replace=_replace(tmp_path),
                                  rename=_replace(tmp_path)):
        stage = RunDir("gs://bucket/run").stage("grpo").make()
        logger = MetricsLogger(stage, total_steps=2, tensorboard=False)
        logger.log(1, {"loss": 2.0})
        logger.log(2, {"loss": 1.0})
        append_line(stage.samples, '{"step": 2}')
        assert [r["step"] for r in read_jsonl(stage.metrics)] == [1, 2]
    assert "a" not in "".join(modes) and modes
    local = tmp_path / "bucket" / "run" / "grpo"
    assert [json.loads(x)["step"] for x in (local / "grpo_metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (local / "samples.jsonl").read_text() == '{"step": 2}\n'


def _local(root, path) -> str:
    text = os.fspath(path)
    return os.fspath(root / text[len("gs://"):]) if text.startswith("gs://") else text


def _replace(root):
    return lambda original, path, dst, *args, **kwargs: original(_local(root, path), _local(root, dst))


def test_an_epath_local_root_is_a_plain_directory(tmp_path):
    run = RunDir(f"file://{tmp_path}/run").make()
    assert run.local and isinstance(run.root, epath.Path)
    run.write_config(_config({"pipeline": "sao", "seed": 3}))
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"pipeline": "sao", "seed": 3}
    assert run.read_config().seed == 3
