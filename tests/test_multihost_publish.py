"""The weight publish across processes: 2 JAX processes x 4 CPU devices on this machine (loopback coordinator),
the learner's params on process 1's devices, two rollout replicas on process 0's. `Publisher`'s two collective
programs deliver every replica shard bit for bit (bf16 of the same values); a plain `jax.device_put` of the same
params into a replica's layout is refused by JAX in a multi-process run, which is why publishing uses programs. And
`all_gather_objects` (how trajectories reach the learner hosts) hands both processes both processes' objects."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mercury_jax.bench.local_processes import free_port

WORKER = Path(__file__).with_name("multihost_publish_worker.py")


@pytest.mark.slow
def test_publish_reaches_replicas_on_another_process():
    port = free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)  # the worker asks for 4 devices per process itself
        procs.append(subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            line = [line for line in out.splitlines() if line.startswith("{")][-1]
            report = json.loads(line)
            results[report["process"]] = report
    finally:
        for proc in procs:
            proc.kill()
    assert set(results) == {0, 1}
    for report in results.values():
        assert report["processes"] == 2 and report["devices"] == 8 and report["local_devices"] == 4
        assert report["supports"] and report["mismatched_shards"] == 0
        assert report["device_put"].startswith("refused")
    expected = [{"process": p, "items": list(range(3 + 5 * p))} for p in range(2)]
    assert results[0]["gathered"] == results[1]["gathered"] == expected  # every process's object, in order
    # process 0 holds both replicas' devices: every replica leaf's shards (2 replicas x 2 devices each) checked there
    assert results[0]["checked_shards"] > 0 and results[1]["checked_shards"] == 0
