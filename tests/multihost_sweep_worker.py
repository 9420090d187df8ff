"""One process of `test_sweep_layout.py`'s multi-process sweep: 4 CPU devices of a 2-process JAX, run as

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \
        python tests/multihost_sweep_worker.py WORKDIR OUT

Both processes run `python -m mercury_jax.sweep --workdir WORKDIR --out OUT --recompute` together (the run's rollout
replicas spread over both hosts). Prints one JSON line: the summary every process returned, and the replicas this
process drove.
"""
from __future__ import annotations

import io
import json
import sys

import jax

from mercury_jax.parallel.distributed import initialize_from_env
from mercury_jax.sweep import run_sweep


def main(workdir: str, out: str) -> None:
    initialize_from_env()  # before any device is touched: every process of the run joins first
    log = io.StringIO()
    summary = run_sweep(workdir, out=out, recompute=True, stream=log)
    print(json.dumps({"process": jax.process_index(), "summary": summary, "log": log.getvalue()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
