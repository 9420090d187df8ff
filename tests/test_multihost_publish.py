"""The weight publish across processes: 2 JAX processes x 4 CPU devices on this machine (loopback coordinator),
the learner's params on process 1's devices, two rollout replicas on process 0's. `Publisher`'s two collective
programs deliver every replica shard bit for bit (bf16 of the same values); a plain `jax.device_put` of the same
params into a replica's layout is refused by JAX in a multi-process run, which is why publishing uses programs. And
`all_gather_objects` (how trajectories reach the learner hosts) hands both processes both processes' objects."""
from __future__ import annotations

from pathlib import Path

import pytest
from local_processes import run_reporting_script

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

WORKER = Path(__file__).with_name("multihost_publish_worker.py")


@pytest.mark.slow
def test_publish_reaches_replicas_on_another_process():
    results = run_reporting_script(WORKER, devices=4, processes=2, timeout_s=240)
    assert set(results) == {0, 1}
    for report in results.values():
        assert report["processes"] == 2 and report["devices"] == 8 and report["local_devices"] == 4
        assert report["supports"] and report["mismatched_shards"] == 0
        assert report["device_put"].startswith("refused")
    expected = [{"process": p, "items": list(range(3 + 5 * p))} for p in range(2)]
    assert results[0]["gathered"] == results[1]["gathered"] == expected  # every process's object, in order
    # process 0 holds both replicas' devices: every replica leaf's shards (2 replicas x 2 devices each) checked there
    assert results[0]["checked_shards"] > 0 and results[1]["checked_shards"] == 0
