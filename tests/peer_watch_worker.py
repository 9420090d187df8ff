"""One process of a 2-process run for tests/test_peer_watch.py: multi-process JAX on CPU, `run_guard` around a
stand-in for training (a collective every 0.2 s, as a learner step would do), and, when this is the `victim`, a
SIGKILL of itself (or, with `how` = "raise", an exception) after `kill_after` seconds. The survivor must leave
through the peer watch."""
from __future__ import annotations

import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mercury_jax.parallel import distributed  # noqa: E402  (after XLA_FLAGS, the path and the multi-process start above)

distributed.initialize_from_env(heartbeat_timeout_s=60)

import jax  # noqa: E402  (after XLA_FLAGS, the path and the multi-process start above)
import numpy as np  # noqa: E402  (after XLA_FLAGS, the path and the multi-process start above)
from jax.experimental import multihost_utils  # noqa: E402  (after XLA_FLAGS, the path and the multi-process start above)

from mercury_jax.runs.run_guard import run_guard  # noqa: E402  (after XLA_FLAGS, the path and the multi-process start above)
from mercury_jax.runs.rundir import RunDir  # noqa: E402  (after XLA_FLAGS, the path and the multi-process start above)


def main(workdir: str, victim: int, kill_after: float, timeout_s: float, how: str) -> None:
    run = RunDir(workdir).make()
    with run_guard(run, ["main.py", "--config", "experiments/sao.py:tiny"], peer_timeout_s=timeout_s):
        print(f"process {jax.process_index()} running", flush=True)
        start = time.time()
        while True:
            if jax.process_index() == victim and time.time() - start > kill_after:
                if how == "raise":
                    raise ValueError("a bad batch on this process only")
                os.kill(os.getpid(), signal.SIGKILL)
            multihost_utils.process_allgather(np.ones(1, np.float32))  # blocks once the peer is gone
            time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
