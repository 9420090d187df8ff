"""Resume exactness of the data order: an SFT run (a user's JSONL corpus, rows rendered and packed in a grain worker
process) and a sync SAO run are SIGKILLed mid-epoch after a committed checkpoint; resumed, each trains on exactly the
rows (record ids) or tasks (task ids) an uninterrupted run trains on, step for step, into the next epoch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sao_resume_worker import run_tiny

from mercury_jax.data.synthetic import write_corpus

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

RECORDS = 30  # the SFT corpus: an epoch is a few steps of 4 rows


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(checkpoints: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []


def _kill_after_checkpoint(children, command: list[str], checkpoints: Path, *, at_least: int, env: dict) -> int:
    """Run `command` in its own process group (owned by `children`: tests/child_processes.py) until step `at_least`
    or later is committed, then SIGKILL the whole group (the trainer and its grain workers, as a lost machine);
    returns the newest committed step."""
    child = children.start(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 600
    while not [s for s in _steps(checkpoints) if s >= at_least]:
        assert child.poll() is None, child.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"the child committed no step >= {at_least} in 600 s"
        time.sleep(0.1)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    return _steps(checkpoints)[-1]


def _env() -> dict:
    # the repository on the path of a script run from tests/; the session's compilation cache too (tests/conftest.py)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_a_sigkilled_sft_run_on_a_user_corpus_resumes_with_the_same_rows(tmp_path, children):
    corpus = tmp_path / "chats.jsonl"
    write_corpus(corpus, RECORDS, words=40)

    def command(workdir: Path, steps: int) -> list[str]:
        return [sys.executable, "-m", "mercury_jax.main", "--config", "experiments/sft.py:tiny", "--workdir",
                str(workdir), f"--config.sft.data={corpus}", "--config.sft.data_workers=1",
                "--config.model.overrides.num_hidden_layers=2", "--config.sft.row_length=512",
                "--config.sft.batch_rows=4", "--config.checkpoint.every=1", "--config.checkpoint.keep=10",
                "--config.sft.log_every=1", f"--config.sft.steps={steps}"]

    killed, fresh = tmp_path / "killed", tmp_path / "fresh"
    last = _kill_after_checkpoint(children, command(killed, 1000), killed / "sft" / "checkpoints", at_least=2,
                                  env=_env())
    total = last + 6
    outputs = []
    for workdir in (killed, fresh):
        done = subprocess.run(command(workdir, total), cwd=REPO, env=_env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs.append(done.stdout + done.stderr)
    assert f"[sft] resumed from step {last}" in outputs[0]
    resumed_rows, fresh_rows = _records(killed / "sft" / "batches.jsonl"), _records(fresh / "sft" / "batches.jsonl")
    assert [r["step"] for r in resumed_rows] == [r["step"] for r in fresh_rows] == list(range(1, total + 1))
    assert resumed_rows == fresh_rows
    before_kill = [record for r in fresh_rows[:last] for row in r["rows"] for record in row]
    trained = [record for r in fresh_rows for row in r["rows"] for record in row]
    assert len(before_kill) < RECORDS < len(trained)  # killed mid-epoch; the resumed part runs into the next epoch
    losses = [r["loss"] for r in _records(killed / "sft" / "sft_metrics.jsonl")][last:]
    assert losses == [r["loss"] for r in _records(fresh / "sft" / "sft_metrics.jsonl")][last:]


@pytest.mark.slow
def test_a_sigkilled_sao_run_resumes_with_the_same_tasks(tmp_path, persistent_compilation_cache, children):
    killed = tmp_path / "killed"
    worker = [sys.executable, str(Path(__file__).parent / "sao_resume_worker.py"), str(killed), "1000"]
    last = _kill_after_checkpoint(children, worker, killed / "sao" / "checkpoints", at_least=1, env=_env())
    total = max(last + 3, 6)  # 6 tasks, 2 a step: an epoch every 3 steps; the resumed part crosses an epoch boundary
    run_tiny(killed, total)
    run_tiny(tmp_path / "fresh", total)
    resumed, fresh = _records(killed / "sao" / "batches.jsonl"), _records(tmp_path / "fresh" / "sao" / "batches.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in fresh] == list(range(1, total + 1))
    assert [r["task_ids"] for r in resumed] == [r["task_ids"] for r in fresh]
    assert [r["episode_ids"] for r in resumed] == [r["episode_ids"] for r in fresh]
    tasks = [t for r in fresh for t in r["task_ids"]]
    assert sorted(tasks[:6]) == sorted(tasks[6:12]) and tasks[:6] != tasks[6:12]  # whole epochs, reshuffled
