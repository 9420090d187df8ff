"""Checkpoints of learner roles that live on some hosts only (runs/checkpoint_roles.py), on 5 processes of this
machine (tests/multihost_checkpoint_worker.py): each role is its own Orbax item, every process writes and reads the
shards it holds, nothing goes through a host copy; the files are ordinary Orbax items (export reads them in one
process), and a damaged role item is named by the resume's file check."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from local_processes import run_reporting_script

from mercury_jax.runs.checkpoint_faults import unreadable_reason
from mercury_jax.runs.run_reader import checkpoint_steps, read_checkpoint_arrays

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

WORKER = Path(__file__).with_name("multihost_checkpoint_worker.py")
PROCESSES = 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    workdir = tmp_path_factory.mktemp("roles") / "checkpoints"
    reports = run_reporting_script(WORKER, devices=2, processes=PROCESSES, args=(str(workdir),))
    return workdir, reports


@pytest.mark.slow
def test_each_role_is_saved_and_restored_by_the_processes_that_hold_it(saved):
    workdir, reports = saved
    assert set(reports) == set(range(PROCESSES))
    for process, report in reports.items():
        assert report["layout"] == "roles" and report["primaries"] == {"actor": 1, "critic": 3}
        assert report["step"] == 2 and report["mismatched"] == 0
        # the rollout host holds no learner shard; each learner host its role's 2 devices x 3 arrays
        assert report["shards"] == (0 if process == 0 else 6), report
    step = workdir / "2"
    assert sorted(p.name for p in step.iterdir() if p.name.startswith("arrays")) == ["arrays_actor", "arrays_critic"]
    writers = {item: sorted(p.name for p in (step / item).glob("ocdbt.process_*")) for item in ("arrays_actor",
                                                                                                "arrays_critic")}
    assert writers == {"arrays_actor": ["ocdbt.process_1", "ocdbt.process_2"],
                       "arrays_critic": ["ocdbt.process_3", "ocdbt.process_4"]}


@pytest.mark.slow
def test_role_items_read_in_one_process_and_damage_is_named(saved, tmp_path):
    workdir, _ = saved
    assert checkpoint_steps(workdir) == [1, 2]
    actor = read_checkpoint_arrays(workdir / "2" / "arrays_actor")
    np.testing.assert_array_equal(actor[("w",)], np.arange(32, dtype=np.float32).reshape(8, 4) + 2)
    critic = read_checkpoint_arrays(workdir / "2" / "arrays_critic")
    np.testing.assert_array_equal(critic[("m",)], np.full((8,), 102.0, np.float32))
    assert unreadable_reason(workdir / "2") is None
    damaged = tmp_path / "2"
    subprocess.run(["cp", "-r", str(workdir / "2"), str(damaged)], check=True)
    (damaged / "arrays_critic" / "manifest.ocdbt").unlink()
    assert unreadable_reason(damaged) == "arrays_critic/manifest.ocdbt is missing (the index of the array store)"
