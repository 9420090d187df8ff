"""The pipelines on several processes (a stand-in for a pod's hosts), equal to one process.

Each test runs `python -m mercury_jax.main --config tests/multihost_config.py:PIPELINE` on this machine: one
process of 8 CPU devices straight through (the reference), then 2 processes (loopback coordinator, gloo
collectives); the SAO test kills them by SIGKILL once a mid-run checkpoint is committed and resumes the same 2
processes to the end (the resume restores both pipelines' checkpoints through the same `loop.py`, so one
pipeline carries it). The phases of a test share a persistent compilation cache (a resume compiles the programs
the killed run did).
Every device group spans both processes (`device_layout = "per_process"`): each process drives its own rollout
replicas, trajectories reach both through the host all-gather, learner batches are placed from every host, the
weights are published by collectives and the checkpoints are written by both. The metrics (all but wall-clock
ones) and the evaluations must equal the reference's exactly: the two-way reductions of the learner meshes sum the
same two numbers in either process layout, and a request's tokens depend only on its seed, id and weights.

Each of the 2 processes has 8 CPU devices too, of which the run's groups take 4: XLA's CPU backend rounds a sharded
matmul's gradient differently depending on how many devices its process has (measured on one 2-device fsdp matmul:
2-5, 6-7, 8 and 16 local devices give different bits, the same across processes for equal counts), so an exact
comparison needs the same count per process; 2 processes x 4 devices agree with 1 x 8 to ~1e-7 relative.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "tests/multihost_config.py"
PHASE_TIMEOUT_S = 900
DEVICES_PER_PROCESS = 8  # the reference's count in every process (see above)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(pipeline: str, workdir: Path, logs: Path, processes: int, *, devices: int = DEVICES_PER_PROCESS,
            overrides: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_COMPILATION_CACHE_DIR=str(logs.parent / "xla_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        # the test process's own multi-process or TPU settings (the AOT benchmarks set TPU_WORKER_HOSTNAMES) stay out
        for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TPU_WORKER_HOSTNAMES"):
            env.pop(name, None)
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(rank))
        log = open(logs / f"{workdir.name}-p{rank}.log", "ab")  # noqa: SIM115  (closed with the process)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mercury_jax.main", "--config", f"{CONFIG}:{pipeline}", "--workdir", str(workdir),
             *overrides],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        procs[-1].log = log
    return procs


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("*.log")))


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
        p.log.close()


def _wait(procs, logs: Path, until=None, expect: int = 0) -> bool:
    """Wait for every process to exit with `expect` (True), or for `until()` (then False, the processes still
    running)."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, expect) for c in codes):
            _kill(procs)
            pytest.fail(f"a process exited with {codes}\n{_tails(logs)}")
        if until is not None and until():
            return False
        if all(c == expect for c in codes):
            for p in procs:
                p.log.close()
            return True
        time.sleep(0.1)
    _kill(procs)
    pytest.fail(f"no result within {PHASE_TIMEOUT_S} s\n{_tails(logs)}")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _deterministic(record: dict) -> dict:
    """A metrics record without its wall-clock figures (seconds, rates per second)."""
    return {k: v for k, v in record.items() if not (k.endswith("_s") or k.endswith("per_s") or "seconds" in k)}


def _committed(checkpoints: Path, step: int):
    return lambda: (checkpoints / str(step)).is_dir()  # Orbax renames the step's folder in once both wrote


@pytest.fixture(scope="module")
def sao_reference(tmp_path_factory) -> Path:
    """The SAO config on one process of 8 devices: the reference of both layouts (on one process the groups take the
    same devices in either)."""
    logs = tmp_path_factory.mktemp("sao-reference")
    reference = logs / "one-process"
    assert _wait(_launch("sao", reference, logs, 1), logs)
    return reference


def _run(pipeline: str, tmp_path: Path, *, kill_after: tuple[str, int] | None = None,
         reference: Path | None = None) -> tuple[Path, Path, Path]:
    """The reference (unless given), then the 2-process run (killed once `kill_after` = (stage, step)'s checkpoint
    is committed, and resumed); returns (reference workdir, 2-process workdir, logs)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    multi = tmp_path / "two-processes"
    if reference is None:
        reference = tmp_path / "one-process"
        assert _wait(_launch(pipeline, reference, logs, 1), logs)
    procs = _launch(pipeline, multi, logs, 2)
    if kill_after is not None:
        stage, step = kill_after
        finished = _wait(procs, logs, until=_committed(multi / stage / "checkpoints", step))
        assert not finished, f"the run ended before the kill (step {step}'s checkpoint came too late)"
        _kill(procs)
        procs = _launch(pipeline, multi, logs, 2)
    assert _wait(procs, logs)
    return reference, multi, logs


def _assert_same_run(reference: Path, multi: Path, stage: str, logs: Path, starts: int = 2,
                     rounding: tuple[str, ...] = ()) -> None:
    """Equal metrics, except the `rounding` keys: within 1e-6 (diagnostics that compare two programs' log-probs)."""
    name = f"{stage}_metrics.jsonl"
    one, two = _records(reference / stage / name), _records(multi / stage / name)
    assert [r["step"] for r in two] == [r["step"] for r in one], "process 0 alone writes one record a step"
    for a, b in zip(one, two):
        a, b = _deterministic(a), _deterministic(b)
        for key in rounding:
            if key in a or key in b:
                assert b.pop(key) == pytest.approx(a.pop(key), abs=1e-6), f"step {a['step']}: {key}"
        assert b == a, f"step {a['step']}\n{_tails(logs)}"
    events = list((multi / stage / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(events) == starts, f"one TensorBoard file per start of process 0, got {[e.name for e in events]}"


@pytest.mark.slow
def test_sao_on_two_processes_killed_and_resumed_equals_one_process(tmp_path, sao_reference):
    reference, multi, logs = _run("sao", tmp_path, kill_after=("sao", 3), reference=sao_reference)
    _assert_same_run(reference, multi, "sao", logs)
    _assert_same_run(reference, multi, "sft", logs)  # the warm start: non-zero gradients over both processes
    log = (logs / "two-processes-p0.log").read_text()
    assert "resumed from step 3" in log
    evals_one, evals_two = _records(reference / "sao" / "evals.jsonl"), _records(multi / "sao" / "evals.jsonl")
    assert evals_two == evals_one and len(evals_one) == 2  # warm start and final, written once
    shards = {p.name for p in (multi / "sao" / "checkpoints" / "5").rglob("ocdbt.process_*")}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards, shards  # both processes wrote their shards


@pytest.mark.slow
def test_grpo_on_two_processes_equals_one_process(tmp_path):
    reference, multi, logs = _run("grpo", tmp_path)
    _assert_same_run(reference, multi, "grpo", logs, starts=1)
    samples_one = _records(reference / "grpo" / "samples.jsonl")
    assert _records(multi / "grpo" / "samples.jsonl") == samples_one  # written once, the same sampled texts


@pytest.mark.slow
def test_sao_consecutive_layout_preempted_on_one_process_equals_one_process(tmp_path, sao_reference):
    """The released layout: whole hosts per role (rollout on process 0, actor and critic on process 1, 4 devices a
    process), so each process holds none of some group's devices. A SIGTERM to process 1 alone, mid-run: both
    processes checkpoint the same step (JAX's preemption sync point) and exit 143; the rerun resumes there and ends
    with the 1-process run's metrics. The learner's process has 4 devices here and the reference's 8 (XLA:CPU rounds
    a sharded gradient by the local device count), so the one diagnostic that compares the learner's log-probs with
    the sampler's differs in its 7th digit; everything else is equal."""
    logs = tmp_path / "logs"
    logs.mkdir()
    multi = tmp_path / "consecutive"
    layout = ("--config.device_layout=consecutive",)
    procs = _launch("sao", multi, logs, 2, devices=4, overrides=layout)
    metrics = multi / "sao" / "sao_metrics.jsonl"
    assert not _wait(procs, logs, until=lambda: metrics.exists() and len(_records(metrics)) >= 2)
    procs[1].send_signal(signal.SIGTERM)
    assert _wait(procs, logs, expect=143)
    saved = [re.search(r"\[sao\] SIGTERM received: checkpoint of step (\d+)", (logs / f"consecutive-p{r}.log")
                       .read_text()) for r in range(2)]
    assert all(saved) and saved[0].group(1) == saved[1].group(1), _tails(logs)
    step = int(saved[0].group(1))
    assert 2 <= step < 5 and (multi / "sao" / "checkpoints" / str(step)).is_dir()
    assert _wait(_launch("sao", multi, logs, 2, devices=4, overrides=layout), logs)
    assert f"resumed from step {step}" in (logs / "consecutive-p0.log").read_text()
    _assert_same_run(sao_reference, multi, "sao", logs, rounding=("logp_train_rollout_gap",))
    _assert_same_run(sao_reference, multi, "sft", logs)
    assert _records(multi / "sao" / "evals.jsonl") == _records(sao_reference / "sao" / "evals.jsonl")

