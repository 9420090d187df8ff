"""Checkpoints that fail safely (issue #34 items 2 and 3): a damaged newest step is skipped on resume (the run
continues from the newest step that restores, bit for bit as if it had stopped there), nothing restorable is one
named error that renames nothing, export names a damaged step (a `RunReadError`) and an older one, and a save
that hits a write error (EFBIG from `RLIMIT_FSIZE`, a real OS error in tensorstore's write path) stops the run
with `CheckpointSaveError` naming the step and the last committed step.

The state is one small array (`Summing`: step s adds s to it), saved by the real `run_loop` and Orbax.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
import signal
from pathlib import Path

import ml_collections
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from mercury_jax.export import export_run
from mercury_jax.runs.checkpoints import Checkpointer, CheckpointRestoreError, CheckpointSaveError
from mercury_jax.runs.run_reader import RunReader, RunReadError, save_run_config
from mercury_jax.runs.rundir import RunDir
from mercury_jax.train.loop import Cadence, StepResult, run_loop

SIZE = 4096  # random float32 values in the state: its compressed data file (~6 KB) exceeds FILE_LIMIT, the JSON
FILE_LIMIT = 4096  # files and the few metric rows written under the limit do not
START = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)


class Summing:
    """Step s adds s to every entry of the state (random at step 0); `calls` records the steps run."""
    stage = "sao"
    progress_keys = plot_keys = ("loss",)

    def __init__(self, steps: int, key: str = "total"):
        self.steps, self.key, self.total, self.calls = steps, key, START.copy(), []

    def arrays(self):
        return {self.key: self.total}

    def meta(self):
        return {}

    def restore(self, arrays, meta):
        self.total = np.asarray(arrays[self.key])

    def policy(self):
        return None

    def step(self, step, *, version, guard):
        self.calls.append(step)
        self.total = self.total + step
        return StepResult({"loss": 1.0})


def cadence(async_save: bool = False) -> Cadence:
    return Cadence(checkpoint_every=1, keep=10, async_save=async_save)


def _names(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


def _steps(checkpoints: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def _truncate_largest_data_file(step_dir: Path) -> Path:
    data = max((p for p in (step_dir / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    return data


DAMAGE = {  # what each does to the run's newest step (4) or next to it; the reason the resume must print
    "truncated_data_file": (lambda c: _truncate_largest_data_file(c / "4"), 4, r"ValueError: .*byte range"),
    "deleted_manifest": (lambda c: (c / "4" / "arrays" / "manifest.ocdbt").unlink(), 4,
                         r"arrays/manifest\.ocdbt is missing"),
    "empty_newer_step": (lambda c: (c / "5").mkdir(), 5, r"the directory is empty"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_step_resumes_from_the_previous_good_one(tmp_path, capsys, damage):
    stage = RunDir(tmp_path).stage("sao")
    run_loop(Summing(4), stage, cadence())
    damage_fn, bad_step, reason = DAMAGE[damage]
    damage_fn(Path(stage.checkpoints))
    if damage == "truncated_data_file":  # the damage is real: the step itself no longer restores
        checkpointer = Checkpointer(stage.checkpoints, save_every=1, keep=10, async_save=False)
        with pytest.raises(ValueError, match="byte range"):
            checkpointer.restore(4, Summing(0).arrays())
        checkpointer.close()
    capsys.readouterr()

    resumed = Summing(6)
    run_loop(resumed, stage, cadence())
    good = 4 if damage == "empty_newer_step" else 3
    assert resumed.calls == list(range(good + 1, 7))
    uninterrupted = Summing(6)
    run_loop(uninterrupted, RunDir(tmp_path / "uninterrupted").stage("sao"), cadence())
    np.testing.assert_array_equal(resumed.total, uninterrupted.total)  # bit for bit: the same float additions
    printed = capsys.readouterr().out.splitlines()
    skipped = [line for line in printed if "cannot be restored" in line]
    assert len(skipped) == 1, printed
    assert re.search(rf"checkpoint step {bad_step} in \S+ cannot be restored, skipped \({reason}.*\); trying step "
                     rf"{good}$", skipped[0]), skipped[0]
    assert "Traceback" not in "\n".join(printed)
    # the bad step is kept under another name (invisible to Orbax), and the run saved that step number afresh
    corrupt = [n for n in _names(Path(stage.checkpoints)) if not n.isdigit()]
    assert len(corrupt) == 1 and re.fullmatch(rf"{bad_step}\.corrupt-\d{{8}}T\d{{6}}Z", corrupt[0]), corrupt
    assert _steps(Path(stage.checkpoints)) == [1, 2, 3, 4, 5, 6]
    assert any(f"{bad_step} -> {corrupt[0]}" in line for line in printed)


def test_no_restorable_step_is_one_error_listing_each_and_moves_nothing(tmp_path):
    stage = RunDir(tmp_path).stage("sao")
    run_loop(Summing(2), stage, cadence())
    checkpoints = Path(stage.checkpoints)
    (checkpoints / "2" / "arrays" / "manifest.ocdbt").unlink()
    _truncate_largest_data_file(checkpoints / "1")
    before = _names(checkpoints)
    with pytest.raises(CheckpointRestoreError, match=r"no checkpoint step in \S+ can be restored \(step 2: arrays/"
                                                     r"manifest\.ocdbt is missing.*; step 1: ValueError: .*\); "
                                                     r"nothing was moved or deleted"):
        run_loop(Summing(4), stage, cadence())
    assert _names(checkpoints) == before


def test_a_state_that_fits_no_step_renames_none_of_them(tmp_path):
    """A changed state (here a renamed array) fails on every step alike: an error, and the good steps stay put."""
    stage = RunDir(tmp_path).stage("sao")
    run_loop(Summing(2), stage, cadence())
    before = _names(Path(stage.checkpoints))
    with pytest.raises(CheckpointRestoreError, match=r"step 2: .*; step 1: "):
        run_loop(Summing(4, key="renamed"), stage, cadence())
    assert _names(Path(stage.checkpoints)) == before == ["1", "2"]


# ------------------------------------------------------------------------------------------------ export
def test_export_of_a_truncated_checkpoint_names_the_step_the_file_and_an_older_step(tmp_path, monkeypatch):
    """A tiny Qwen3.5-MoE policy in the SAO layout; `RunReader.abstract_policy` is stubbed to that model so that no
    tokenizer is built (the read is what is under test). The export streams, so the damaged data file is found when
    the first array in it is read, before the export directory is swapped in."""
    from models.qwen35_moe import Qwen35MoeForCausalLM
    from models.qwen35_moe import config as C

    def policy():
        return Qwen35MoeForCausalLM(C.tiny(vocab_size=64, num_hidden_layers=2, full_attention_interval=2),
                                    rngs=nnx.Rngs(0))

    monkeypatch.setattr(RunReader, "abstract_policy", lambda self: nnx.eval_shape(policy))
    save_run_config(ml_collections.ConfigDict({"pipeline": "sao", "model": {"hf_path": ""},
                                               "tokenizer": {"kind": "qwen35"}}), tmp_path)
    _, params = nnx.split(policy(), nnx.Param)
    checkpointer = Checkpointer(RunDir(tmp_path).stage("sao").checkpoints, save_every=1, keep=10, async_save=False)
    for step in (1, 2):
        checkpointer.save(step, {"actor": {"params": params, "frozen": {}}}, {"step": step})
    checkpointer.close()
    _truncate_largest_data_file(tmp_path / "sao" / "checkpoints" / "2")
    expected = (r"^sao checkpoint step 2 cannot be read: \S+/sao/checkpoints/2/arrays cannot be read \(ValueError: "
                r"OUT_OF_RANGE: Error reading \"actor\.params\.\S+\.value/[0-9.]+\" .*\); the save was interrupted "
                r"or the checkpoint was damaged; use an older step, --step 1 \(available steps: \[1, 2\]\)$")
    out = tmp_path / "out"
    with pytest.raises(RunReadError, match=expected):
        export_run(tmp_path, out)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written is left
    export_run(tmp_path, out, step=1, dtype="float32")  # the fix the message names works
    model, stage, step = RunReader(tmp_path).restore_policy(step=1)
    assert (stage, step) == ("sao", 1)
    with safe_open(out / "model.safetensors", "numpy") as exported:
        np.testing.assert_array_equal(exported.get_tensor("model.language_model.embed_tokens.weight"),
                                      params["model"]["embed"][...])


# ------------------------------------------------------------------------------------------------ saves
@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored) in this process until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_stops_the_run_with_one_named_error(tmp_path, capfd, caplog, async_save):
    stage, limits = RunDir(tmp_path).stage("sao"), contextlib.ExitStack()

    class LimitedFromStep3(Checkpointer):
        def save(self, step, arrays, meta):
            if step == 3:  # the disk "fills up" once step 2's (async) save is on disk
                self.manager.wait_until_finished()
                limits.enter_context(file_size_limit(FILE_LIMIT))
            super().save(step, arrays, meta)

    algorithm = Summing(6)
    with limits, pytest.raises(CheckpointSaveError) as raised:
        run_loop(algorithm, stage, cadence(async_save), make_checkpointer=LimitedFromStep3)
    message = str(raised.value)
    assert re.fullmatch(r"checkpoint step 3 could not be saved in \S+: EFBIG \(File too large\) writing \S+/3\.orbax-"
                        r"checkpoint-tmp/\S+; step 3 is not committed and the last committed step is 2 \(a resume "
                        r"continues from it\)\. To go on: raise the file-size limit .*, then resume", message), message
    # sync: the save of step 3 raises; async: its error surfaces right after the save started or, at the latest,
    # when step 4 is to be saved (which then is not)
    assert algorithm.calls in ([[1, 2, 3]] if not async_save else [[1, 2, 3], [1, 2, 3, 4]])
    assert _steps(Path(stage.checkpoints)) == [1, 2]
    output = capfd.readouterr()
    assert "Traceback" not in output.out + output.err
    orbax_errors = [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.ERROR]
    assert 1 <= len(orbax_errors) <= 4  # Orbax logs the failure once from each thread it crossed ...
    for record in orbax_errors:  # ... as one line each, without the traceback (hundreds of lines in all)
        assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
        assert record.getMessage().endswith("; traceback omitted]")

    resumed = Summing(6)  # the limit lifted, the resume re-saves step 3 over the failed save's leftovers
    run_loop(resumed, stage, cadence(async_save))
    assert resumed.calls == [3, 4, 5, 6] and _steps(Path(stage.checkpoints)) == [1, 2, 3, 4, 5, 6]
    uninterrupted = Summing(6)
    run_loop(uninterrupted, RunDir(tmp_path / "uninterrupted").stage("sao"), cadence())
    np.testing.assert_array_equal(resumed.total, uninterrupted.total)
    assert json.loads((Path(stage.checkpoints) / "6" / "meta" / "metadata").read_text())["step"] == 6
