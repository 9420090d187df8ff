"""Multi-process JAX from the environment: one process per host of a pod, or several on one machine.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i python -m ...

`initialize_from_env()` calls `jax.distributed.initialize` with those three variables when they are set (on CPU it
selects gloo collectives first, which cross-process programs on CPU devices need), and does nothing otherwise.
Call it before anything touches a device. `all_gather_objects(obj)` hands every process every process's picklable
object (how trajectories reach the learner hosts, docs/DESIGN.md "Multi-host").
"""
from __future__ import annotations

import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_from_env(environ=os.environ) -> bool:
    """`jax.distributed.initialize` from `ENV` when all three are set (True); False when none is. ValueError naming
    the missing ones when only some are set."""
    present = [name for name in ENV if environ.get(name)]
    if not present:
        return False
    if len(present) != len(ENV):
        missing = [name for name in ENV if name not in present]
        raise ValueError(f"multi-process JAX needs {', '.join(ENV)}; {', '.join(missing)} not set (set all three, "
                         "or none for a single process)")
    if environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=environ["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(environ["JAX_NUM_PROCESSES"]),
                               process_id=int(environ["JAX_PROCESS_ID"]))
    return True


def all_gather_objects(obj) -> list:
    """`obj` (picklable) of every process, in process order, on every process; `[obj]` in a single process. Two
    collectives over all devices: the byte counts, then the bytes padded to the longest."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(gathered[p, :sizes[p]].tobytes()) for p in range(jax.process_count())]
