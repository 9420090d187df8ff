"""The checkpoint sweep on the released rollout layout (`train/checkpoint_engine.py`, `runs/replica_restore.py`)
against the single-device sweep of the same checkpoints.

Three copies of one tiny pivot-GRPO run (checkpoints 0 and 1 of a random policy), differing in config.json only:
`single` (one engine on one device, fp32, the ragged MoE), `replicas_fp32` and `replicas_bf16` (the released
structure: a rollout group of its own, replicas of {"fsdp": 2} over the 8 devices, `moe_impl="ep"`, rollout weights
fp32 / bf16). A request's tokens depend only on (seed, request id, weights): in fp32 the replicas must sample every
episode token for token as the single device does (XLA's sharded sums may round differently, but a flip would need
a draw within ~1e-7 of a boundary); in bf16 the episodes may differ, and the test reports how many do while the
per-task outcomes and the selection must agree. A random policy neither answers nor over-searches, so the token
digests are what makes the comparison sharp.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from local_processes import run_reporting_script
from sweep_runs import released_structure, same_run_with_config, save_checkpoints, start_run, tiny_grpo_config

from mercury_jax.runs.replica_restore import restore_into_replicas
from mercury_jax.runs.run_reader import RunReader, read_checkpoint_arrays
from mercury_jax.sweep import run_sweep
from mercury_jax.train.checkpoint_engine import CheckpointEngine

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

WORKER = Path(__file__).with_name("multihost_sweep_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    config = tiny_grpo_config(num_eval_tasks=6, num_slots=4)
    config.rollout.max_tool_turns, config.rollout.max_turn_tokens = 2, 32
    single = save_checkpoints(start_run(root / "single", config))
    return {"single": single,
            "replicas_fp32": same_run_with_config(single, root / "replicas_fp32", released_structure(config, "")),
            "replicas_bf16": same_run_with_config(single, root / "replicas_bf16",
                                                  released_structure(config, "bfloat16"))}


@pytest.fixture(scope="module")
def sweeps(runs) -> dict[str, dict]:
    """Each copy's sweep summary; the single-device one read through a `file://` URL."""
    out = {}
    for name, workdir in runs.items():
        location = f"file://{workdir}" if name == "single" else workdir
        out[name] = run_sweep(location, stream=io.StringIO(), recompute=True)
    return out


def digests(summary: dict) -> dict[int, list[str]]:
    return {r["step"]: r["outcomes"]["token_digests"] for r in summary["records"]}


def outcomes(summary: dict) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r["outcomes"].items() if k != "token_digests"} for r in summary["records"]}


@pytest.mark.slow
def test_replicas_restore_the_checkpoint_cast_and_split_over_each_replica(runs):
    reader = RunReader(runs["replicas_bf16"])
    engine = CheckpointEngine(reader, "grpo")
    assert engine.num_replicas == 4 and engine.slots == 2  # 8 devices / 2; the run's 4 slots over its 2 replicas
    weights = restore_into_replicas(reader, "grpo", 1, engine.meshes, dtype="bfloat16")
    saved = read_checkpoint_arrays(runs["replicas_bf16"] / "grpo" / "checkpoints" / "1" / "arrays",
                                   ("actor", "params"))
    assert len(weights) == 4
    for replica, (mesh, state) in enumerate(zip(engine.meshes, weights)):
        flat = {tuple(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(state)}
        assert saved.keys() <= flat.keys()
        for name, expected in saved.items():
            array = flat[name]
            assert array.dtype == jax.numpy.bfloat16, name
            assert set(array.sharding.device_set) == set(mesh.devices.flat), (replica, name)
            np.testing.assert_array_equal(np.asarray(array), expected.astype(jax.numpy.bfloat16))
        sharded = [a for a in flat.values() if any(entry is not None for entry in a.sharding.spec)]
        assert sharded and all(s.data.size < a.size for a in sharded for s in a.addressable_shards)


@pytest.mark.slow
def test_fp32_replicas_sample_every_episode_as_the_single_device_does(sweeps):
    assert digests(sweeps["replicas_fp32"]) == digests(sweeps["single"])
    assert outcomes(sweeps["replicas_fp32"]) == outcomes(sweeps["single"])
    assert sweeps["replicas_fp32"]["selection"] == sweeps["single"]["selection"]


@pytest.mark.slow
def test_bf16_replicas_give_the_same_outcomes_and_selection(sweeps, capsys):
    same = {step: sum(a == b for a, b in zip(digests(sweeps["replicas_bf16"])[step], ds))
            for step, ds in digests(sweeps["single"]).items()}
    with capsys.disabled():
        print(f"\nbf16 replicas vs single-device fp32: identical episodes per step {same} of "
              f"{sweeps['single']['num_tasks']}")
    assert outcomes(sweeps["replicas_bf16"]) == outcomes(sweeps["single"])
    assert sweeps["replicas_bf16"]["selection"]["step"] == sweeps["single"]["selection"]["step"]


@pytest.mark.slow
def test_sweep_on_two_processes_equals_one_process(runs, sweeps, tmp_path):
    out = tmp_path / "sweep"
    reports = run_reporting_script(WORKER, devices=4, processes=2, args=(str(runs["replicas_bf16"]), str(out)),
                                   timeout_s=600)
    assert set(reports) == {0, 1}
    one = sweeps["replicas_bf16"]
    for process, report in reports.items():
        summary = report["summary"]
        assert digests(summary) == digests(one) and outcomes(summary) == outcomes(one), process
        assert summary["selection"] == one["selection"]
        assert ("[sweep] selected checkpoint" in report["log"]) == (process == 0)  # process 0 reports
    written = json.loads((out / "sweep.json").read_text())
    assert written["records"] == one["records"] and (out / "frontier.png").exists()
    assert sorted(p.name for p in (out / "outcomes").iterdir()) == ["0.json", "1.json"]
