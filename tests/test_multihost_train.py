"""The pipelines on several processes (a stand-in for a pod's hosts), equal to one process.

Each test runs `python -m mercury_jax.main --config tests/multihost_config.py:PIPELINE` on this machine: one
process of 8 CPU devices straight through (the reference), then 2 processes (loopback coordinator, gloo
collectives; tests/local_processes.py). The released layout's test preempts the 2 processes and resumes
them (the resume restores both pipelines' checkpoints through the same `loop.py`, so one pipeline carries it). The
runs share the session's persistent compilation cache (a resume compiles the programs the preempted run did).
In the `per_process` tests every device group spans both processes (`device_layout = "per_process"`): each process
drives its own rollout replicas, trajectories reach both through the host all-gather, learner batches are placed
from every host, the weights are published by collectives and the checkpoints are written by both. The metrics
(all but wall-clock ones) and the evaluations must equal the reference's exactly: the two-way reductions of the
learner meshes sum the same two numbers in either process layout, and a request's tokens depend only on its seed,
id and weights.

Each of the 2 processes has 8 CPU devices too, of which the run's groups take 4: XLA's CPU backend rounds a sharded
matmul's gradient differently depending on how many devices its process has (measured on one 2-device fsdp matmul:
2-5, 6-7, 8 and 16 local devices give different bits, the same across processes for equal counts), so an exact
comparison needs the same count per process; 2 processes x 4 devices agree with 1 x 8 to ~1e-7 relative.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import local_processes
import pytest
from child_processes import ChildProcesses

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "tests/multihost_config.py"
PHASE_TIMEOUT_S = 900
DEVICES_PER_PROCESS = 8  # the reference's count in every process (see above)


def _launch(children: ChildProcesses, pipeline: str, workdir: Path, logs: Path, processes: int, *,
            devices: int = DEVICES_PER_PROCESS, overrides: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """`processes` processes of the pipeline (tests/local_processes.py), owned by `children` (killed when the test
    ends), sharing the session's persistent compilation cache (JAX_COMPILATION_CACHE_DIR: tests/conftest.py; a resume
    compiles the programs the killed run did, and every test's runs compile the same tiny model's programs)."""
    return children.own(local_processes.launch(["--config", f"{CONFIG}:{pipeline}", "--workdir", str(workdir),
                                                *overrides], logs=logs, processes=processes, devices=devices,
                                               name=workdir.name))


_kill = local_processes.kill


def _wait(procs, logs: Path, until=None, expect: int = 0) -> bool:
    """Wait for every process to exit with `expect` (True), or for `until()` (then False, the processes still
    running)."""
    return local_processes.wait(procs, logs=logs, timeout_s=PHASE_TIMEOUT_S, until=until, expect=expect)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _deterministic(record: dict) -> dict:
    """A metrics record without its wall-clock figures (seconds, rates per second) and the slot occupancy (process
    0's rollout replicas: in a 2-process run half of them; and it depends on when tool calls return)."""
    return {k: v for k, v in record.items()
            if not (k.endswith("_s") or k.endswith("per_s") or "seconds" in k or k == "slot_occupancy")}


def _committed(checkpoints: Path, step: int):
    return lambda: (checkpoints / str(step)).is_dir()  # Orbax renames the step's folder in once both wrote


@pytest.fixture(scope="module")
def sao_reference(tmp_path_factory) -> Path:
    """The SAO config on one process of 8 devices: the reference of both layouts (on one process the groups take the
    same devices in either)."""
    logs = tmp_path_factory.mktemp("sao-reference")
    reference = logs / "one-process"
    with ChildProcesses() as children:
        assert _wait(_launch(children, "sao", reference, logs, 1), logs)
    return reference


def _run(children: ChildProcesses, pipeline: str, tmp_path: Path, *,
         reference: Path | None = None) -> tuple[Path, Path, Path]:
    """The reference (unless given), then the 2-process run; returns (reference workdir, 2-process workdir, logs)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    multi = tmp_path / "two-processes"
    if reference is None:
        reference = tmp_path / "one-process"
        assert _wait(_launch(children, pipeline, reference, logs, 1), logs)
    assert _wait(_launch(children, pipeline, multi, logs, 2), logs)
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
        assert b == a, f"step {a['step']}\n{local_processes.tails(logs)}"
    events = list((multi / stage / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(events) == starts, f"one TensorBoard file per start of process 0, got {[e.name for e in events]}"


@pytest.mark.slow
def test_sao_on_two_processes_equals_one_process(tmp_path, sao_reference, children):
    """Every group on both processes. Straight through (suite time): the consecutive-layout test below resumes a
    preempted 2-process run, and tests/test_multihost_async.py kills and resumes one."""
    reference, multi, logs = _run(children, "sao", tmp_path, reference=sao_reference)
    _assert_same_run(reference, multi, "sao", logs, starts=1)
    _assert_same_run(reference, multi, "sft", logs, starts=1)  # the warm start: non-zero gradients over both processes
    evals_one, evals_two = _records(reference / "sao" / "evals.jsonl"), _records(multi / "sao" / "evals.jsonl")
    assert evals_two == evals_one and len(evals_one) == 2  # warm start and final, written once
    shards = {p.name for p in (multi / "sao" / "checkpoints" / "5").rglob("ocdbt.process_*")}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards, shards  # both processes wrote their shards


@pytest.mark.slow
def test_sft_on_two_processes_reads_disjoint_shards_and_trains_on_the_same_batches(tmp_path, children):
    """2 processes x 4 devices: each reads only the data shards of the row blocks its devices hold (disjoint, their
    union every shard), places them itself, and the batches (record ids of every row) equal the 1-process run's.
    The learner mesh has 8 devices, so the losses agree to XLA:CPU's cross-process rounding (module docstring)."""
    reference, multi, logs = _run(children, "sft", tmp_path)
    read = [re.search(r"\[sft\] data: process (\d) reads shards \[([\d, ]*)\] of (\d+)",
                      (logs / f"two-processes-p{r}.log").read_text()) for r in range(2)]
    assert all(read), local_processes.tails(logs)
    shards = [{int(k) for k in m.group(2).split(",")} for m in read]
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(int(read[0].group(3)))) and all(
        shards), shards
    rows_one, rows_two = _records(reference / "sft" / "batches.jsonl"), _records(multi / "sft" / "batches.jsonl")
    assert rows_two == rows_one and len(rows_one) == 3
    for k in range(4):  # block k (rows 2k, 2k + 1) of every batch holds only records of shard k: k mod 4
        assert all(r % 4 == k for step in rows_one for row in step["rows"][2 * k:2 * k + 2] for r in row)
    one, two = _records(reference / "sft" / "sft_metrics.jsonl"), _records(multi / "sft" / "sft_metrics.jsonl")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert {p.name for p in (multi / "sft" / "checkpoints" / "3" / "data").iterdir()} >= {
        "process_0-of-2.json", "process_1-of-2.json"}  # each process saved its own shards' position


@pytest.mark.slow
def test_grpo_on_two_processes_equals_one_process(tmp_path, children):
    reference, multi, logs = _run(children, "grpo", tmp_path)
    _assert_same_run(reference, multi, "grpo", logs, starts=1)
    samples_one = _records(reference / "grpo" / "samples.jsonl")
    assert _records(multi / "grpo" / "samples.jsonl") == samples_one  # written once, the same sampled texts


@pytest.mark.slow
def test_sao_consecutive_layout_preempted_on_one_process_equals_one_process(tmp_path, sao_reference, children):
    """The released layout: whole hosts per role (rollout on process 0, actor and critic on process 1, 4 devices a
    process), so each process holds none of some group's devices. A SIGTERM to process 1 alone, mid-run: both
    processes checkpoint the same step (JAX's preemption sync point) and exit 143; the rerun resumes there and ends
    with the 1-process run's metrics. The learner's process has 4 devices here and the reference's 8 (XLA:CPU rounds
    a sharded gradient by the local device count), so the diagnostics that compare the learner's log-probs with the
    sampler's (their gap and the mean ratio exp(logp - rollout_logp): measured 1.0000001 against 1.0), and the SFT
    warm start's gradient norm, may differ in their 7th digit; everything else is equal,
    the SFT rows (read by process 1 alone: process 0 holds no learner device) included."""
    logs = tmp_path / "logs"
    logs.mkdir()
    multi = tmp_path / "consecutive"
    layout = ("--config.device_layout=consecutive",)
    procs = _launch(children, "sao", multi, logs, 2, devices=4, overrides=layout)
    metrics = multi / "sao" / "sao_metrics.jsonl"
    assert not _wait(procs, logs, until=lambda: metrics.exists() and len(_records(metrics)) >= 2)
    procs[1].send_signal(signal.SIGTERM)
    assert _wait(procs, logs, expect=143)
    saved = [re.search(r"\[sao\] SIGTERM received: checkpoint of step (\d+)", (logs / f"consecutive-p{r}.log")
                       .read_text()) for r in range(2)]
    assert all(saved) and saved[0].group(1) == saved[1].group(1), local_processes.tails(logs)
    step = int(saved[0].group(1))
    assert 2 <= step < 5 and (multi / "sao" / "checkpoints" / str(step)).is_dir()
    assert _wait(_launch(children, "sao", multi, logs, 2, devices=4, overrides=layout), logs)
    assert f"resumed from step {step}" in (logs / "consecutive-p0.log").read_text()
    _assert_same_run(sao_reference, multi, "sao", logs, rounding=("logp_train_rollout_gap", "mean_ratio"))
    _assert_same_run(sao_reference, multi, "sft", logs, rounding=("grad_norm",))
    assert _records(multi / "sft" / "batches.jsonl") == _records(sao_reference / "sft" / "batches.jsonl")
    assert _records(multi / "sao" / "evals.jsonl") == _records(sao_reference / "sao" / "evals.jsonl")

