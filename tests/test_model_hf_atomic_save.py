"""`save_hf` replaces an export atomically: killed at any instant, `load_hf` returns the old or the new weights.

Two random weight sets A and B of a tiny model, exported in fp32 (HF layout is transposes and reshapes only, so
the round trip is bit-exact and "is A" means equal bits). Kill points: every boundary between the commit steps,
deterministically (only the first k steps run), and 20 SIGKILLs at seeded random delays while a forked process
overwrites the export in a loop (most land while shards are being written).
"""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from hf_save_worker import SAVE_KWARGS, numpy_model, parameter_shapes

from models.qwen35_moe import atomic_dir, hf
from models.qwen35_moe import config as C
from models.qwen35_moe.hf import load_hf, save_hf

CFG = C.tiny(vocab_size=96, num_hidden_layers=4)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def weight_sets():
    rng = np.random.default_rng(0)
    return [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in parameter_shapes(CFG).items()}
            for _ in range(2)]


@pytest.fixture(scope="module")
def models(weight_sets):
    return [numpy_model(CFG, weights) for weights in weight_sets]


def _which(path, weight_sets) -> str:
    """"A" or "B": the weight set `load_hf(path)` returns, bit for bit; fails if it is neither."""
    loaded = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(load_hf(path)))}
    for label, weights in zip("AB", weight_sets):
        if loaded.keys() == weights.keys() and all(
                np.array_equal(loaded[k].view(np.uint32), weights[k].view(np.uint32)) for k in weights):
            return label
    raise AssertionError(f"load_hf({path}) returned weights that are neither A nor B")


def _leftovers(target: Path) -> list[str]:
    """Everything next to or inside the export that is not the export itself."""
    siblings = sorted(p.name for p in target.parent.iterdir() if p.name != target.name)
    inside = sorted(p.name for p in target.iterdir() if p.name.endswith(".tmp")) if target.is_dir() else []
    return siblings + inside


def test_a_kill_between_any_two_commit_steps_leaves_old_or_new(models, weight_sets, tmp_path, monkeypatch):
    target = tmp_path / "exports" / "model"
    staging, backup = atomic_dir.staging_dir(target).name, atomic_dir.backup_dir(target).name
    all_steps = atomic_dir.replace_steps
    # After k steps: [rename target -> backup, rename staging -> target, fsync parent, delete backup].
    expected = {0: ("A", [staging]), 1: ("B", sorted([backup, staging])), 2: ("B", [backup]), 3: ("B", [backup])}
    for k, (weights, left) in expected.items():
        save_hf(models[0], target, **SAVE_KWARGS)
        assert _leftovers(target) == [], k
        monkeypatch.setattr(atomic_dir, "replace_steps", lambda t, k=k: all_steps(t)[:k])
        save_hf(models[1], target, **SAVE_KWARGS)  # "killed" after step k
        monkeypatch.setattr(atomic_dir, "replace_steps", all_steps)
        assert _leftovers(target) == left, k
        assert target.exists() == (k != 1), k
        if k == 3:  # killed while deleting the backup: half of it is gone
            for shard in sorted(atomic_dir.backup_dir(target).glob("*.safetensors"))[::2]:
                shard.unlink()
        assert _which(target, weight_sets) == weights, k
    save_hf(models[0], target, **SAVE_KWARGS)
    assert _leftovers(target) == [] and _which(target, weight_sets) == "A"


# After k of the commit steps [rename target -> backup, rename staging -> target, fsync parent, delete backup]; "backup
# only" is a target and staging both gone with the backup left (the docstring's "backup -> T when there is no staging").
RECOVERED = {"0 steps": "old", "1 step": "new", "2 steps": "new", "3 steps": "new", "backup only": "old"}


@pytest.mark.parametrize("interrupted", sorted(RECOVERED))
def test_recovery_alone_leaves_the_version_the_docstring_promises(tmp_path, monkeypatch, interrupted):
    """`recover` with no save after it: the target holds exactly the version `committed_dir` showed readers before
    (old before the swap began, new from the moment staging was complete and the old one renamed away), and no
    staging or backup is left. Plain one-file directories: the protocol, not `save_hf`, is under test."""
    target = tmp_path / "export"
    with atomic_dir.replace_directory(target) as new:
        (new / "version").write_text("old")
    all_steps = atomic_dir.replace_steps
    steps_done = 1 if interrupted == "backup only" else int(interrupted[0])
    monkeypatch.setattr(atomic_dir, "replace_steps", lambda t: all_steps(t)[:steps_done])
    with atomic_dir.replace_directory(target) as new:
        (new / "version").write_text("new")
    monkeypatch.undo()
    if interrupted == "backup only":
        atomic_dir.staging_dir(target).rename(tmp_path / "elsewhere")
    expected = RECOVERED[interrupted]
    assert (atomic_dir.committed_dir(target) / "version").read_text() == expected
    atomic_dir.recover(target)
    assert (target / "version").read_text() == expected
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "elsewhere") == ["export"]


def test_a_failed_save_leaves_the_old_export_and_no_staging(models, weight_sets, tmp_path, monkeypatch):
    target = tmp_path / "exports" / "model"
    save_hf(models[0], target, **SAVE_KWARGS)

    all_tensors = hf.hf_tensor_stream

    def half_then_fail(*args, **kwargs):
        for i, item in enumerate(all_tensors(*args, **kwargs)):
            if i == 20:
                raise OSError("disk full")
            yield item

    monkeypatch.setattr(hf, "hf_tensor_stream", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_hf(models[1], target, **SAVE_KWARGS)
    assert _leftovers(target) == []
    assert _which(target, weight_sets) == "A"


def test_overwrite_keeps_other_files_and_replaces_old_shards(models, weight_sets, tmp_path):
    target = tmp_path / "exports" / "model"
    save_hf(models[0], target, **SAVE_KWARGS)
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 2
    (target / "tokenizer.json").write_text("{}")
    (target / "extra").mkdir()
    (target / "extra" / "notes.txt").write_text("kept")
    (target / "model-part-00003.safetensors.tmp").write_bytes(b"left by a killed non-atomic save")
    save_hf(models[1], target, dtype=np.float32)  # one file now: the old shards and index must go
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "extra", "model.safetensors",
                                                         "tokenizer.json"]
    assert (target / "extra" / "notes.txt").read_text() == "kept"
    assert _leftovers(target) == [] and _which(target, weight_sets) == "B"


def test_extra_files_are_part_of_the_same_swap(models, weight_sets, tmp_path, monkeypatch):
    target = tmp_path / "exports" / "model"
    save_hf(models[0], target, **SAVE_KWARGS, extra_files={"chat_template.jinja": "old", "tokenizer.json": b"{1}"})
    source = tmp_path / "vocab.txt"
    source.write_text("a b c")
    all_steps = atomic_dir.replace_steps
    monkeypatch.setattr(atomic_dir, "replace_steps", lambda t: all_steps(t)[:0])  # killed before the swap
    save_hf(models[1], target, **SAVE_KWARGS, extra_files={"chat_template.jinja": "new", "vocab.txt": source})
    assert (target / "chat_template.jinja").read_text() == "old" and not (target / "vocab.txt").exists()
    monkeypatch.setattr(atomic_dir, "replace_steps", all_steps)
    save_hf(models[1], target, **SAVE_KWARGS, extra_files={"chat_template.jinja": "new", "vocab.txt": source})
    assert (target / "chat_template.jinja").read_text() == "new" and (target / "vocab.txt").read_text() == "a b c"
    assert (target / "tokenizer.json").read_bytes() == b"{1}"  # carried over from the old export
    assert _leftovers(target) == [] and _which(target, weight_sets) == "B"
    for bad in ("config.json", "model-00001-of-00002.safetensors", "../escape.txt", "sub/file"):
        with pytest.raises(ValueError, match="must be a plain file name"):
            save_hf(models[0], target, **SAVE_KWARGS, extra_files={bad: "x"})


def test_relative_paths_save_and_load(models, weight_sets, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert save_hf(models[0], "model", **SAVE_KWARGS) == Path("model")
    save_hf(models[1], Path("model"), **SAVE_KWARGS)
    assert _which("model", weight_sets) == "B" and _leftovers(tmp_path / "model") == []


def test_a_symlinked_export_directory_stays_a_link_to_the_new_export(models, weight_sets, tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    save_hf(models[0], real, **SAVE_KWARGS)
    link.symlink_to(real)
    save_hf(models[1], link, **SAVE_KWARGS)
    assert link.is_symlink() and Path(os.readlink(link)) == real
    assert _which(link, weight_sets) == "B" and _leftovers(real) == ["link"]


# --------------------------------------------------------------------------------------------- real SIGKILLs
def _ask(worker: subprocess.Popen, command: str | None, timeout: float = 60.0) -> str:
    """Send one command line (if any) and return the worker's one-line answer."""
    if command is not None:
        worker.stdin.write((command + "\n").encode())
        worker.stdin.flush()
    answer, deadline = b"", time.monotonic() + timeout
    while not answer.endswith(b"\n"):
        ready, _, _ = select.select([worker.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(worker.stdout.fileno(), 4096) if ready else b""
        if not chunk:
            raise AssertionError(f"save worker gave no answer to {command!r} (exit code {worker.poll()})")
        answer += chunk
    return answer.decode().strip()


def test_twenty_sigkills_while_overwriting_leave_old_or_new_weights(models, weight_sets, tmp_path, children):
    target = tmp_path / "exports" / "model"
    start = time.perf_counter()
    save_hf(models[0], target, **SAVE_KWARGS)
    save_seconds = time.perf_counter() - start
    for label, weights in zip("ab", weight_sets):
        np.savez(tmp_path / f"{label}.npz", **weights)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    # its own process group: `children` (tests/conftest.py) kills it with the saver it forked, however the test ends
    worker = children.start([sys.executable, str(TESTS / "hf_save_worker.py"), str(tmp_path / "a.npz"),
                             str(tmp_path / "b.npz"), str(target)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, cwd=TESTS.parent, bufsize=0)
    rng = random.Random(21)
    on_disk, outcomes, killed_mid_write = "A", [], 0
    # Kill times are drawn from a window of 4 first-save durations. A loaded host can slow the child's saves past
    # that, so a kill that found no completed save widens the window (x1.5, up to 40 saves) and a completed one
    # resets it: the kills keep landing both mid-write and after a save.
    window = 4 * save_seconds
    assert _ask(worker, None, timeout=180) == "ready"
    for _ in range(20):
        # The child starts with the set not on disk, so every save it completes flips what load_hf returns.
        pid = int(_ask(worker, f"fork {0 if on_disk == 'B' else 1}"))
        time.sleep(rng.uniform(0.0, window))
        os.kill(pid, signal.SIGKILL)
        status = int(_ask(worker, f"reap {pid}"))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"saver died early: {status}"
        killed_mid_write += atomic_dir.staging_dir(target).exists()
        before, on_disk = on_disk, _which(target, weight_sets)
        outcomes.append(on_disk)
        window = 4 * save_seconds if on_disk != before else min(1.5 * window, 40 * save_seconds)
    children.kill()
    # The kills must have landed at varied points: some mid-write, and some after a completed save.
    assert killed_mid_write >= 3, (killed_mid_write, outcomes)
    assert len(set(outcomes)) == 2, outcomes
    save_hf(models[0], target, **SAVE_KWARGS)
    assert _leftovers(target) == [] and _which(target, weight_sets) == "A"
