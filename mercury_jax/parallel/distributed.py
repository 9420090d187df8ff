"""Multi-process JAX from the environment: one process per host of a pod, or several on one machine.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=N JAX_PROCESS_ID=i python -m ...

`initialize_from_env()` calls `jax.distributed.initialize` with those three variables when they are set (on CPU it
selects gloo collectives first, which cross-process programs on CPU devices need), and does nothing otherwise.
Call it before anything touches a device. `all_gather_objects(obj)` hands every process every process's picklable
object (how trajectories reach the learner hosts, docs/DESIGN.md "Multi-host").
"""
from __future__ import annotations

import functools
import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.parallel import peer_watch

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_from_env(environ=os.environ, *, heartbeat_timeout_s: int = 100) -> bool:
    """`jax.distributed.initialize` from `ENV` when all three are set (True); False when none is. ValueError naming
    the missing ones when only some are set. `heartbeat_timeout_s`: JAX's own (it aborts a process whose peer is
    silent that long; `peer_watch` sets it above its own bound)."""
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
                               process_id=int(environ["JAX_PROCESS_ID"]),
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
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


def is_primary() -> bool:
    """Process 0: the one that writes the run's files (metrics, plots, evaluations, config); every process writes
    its own shards of a checkpoint."""
    return jax.process_index() == 0


def fetch(tree):
    """`tree` with every array's whole value as numpy on this host (`jax.device_get` for any layout): an array
    split over other processes' devices is all-gathered on its mesh, and when some process holds none of its
    devices the values travel by one host-level all-gather. A collective when any leaf spans processes: every
    process calls it with the same tree."""
    leaves, treedef = jax.tree.flatten(tree)
    values, gather = [], False
    everyone = set(range(jax.process_count()))
    for x in leaves:
        if not isinstance(x, jax.Array):
            values.append(np.asarray(x))
            continue
        owners = owning_processes(x)
        if x.is_fully_addressable:
            values.append(np.asarray(jax.device_get(x)))
        elif jax.process_index() in owners:  # the owners run it together (SPMD over the array's devices)
            values.append(np.asarray(x if x.is_fully_replicated else _replicated(x.sharding)(x)))
        else:
            values.append(None)
        # decided from the sharding alone, the same on every process (whether a leaf is fully addressable is not)
        gather |= owners != everyone
    if gather:
        every = all_gather_objects(values)
        values = [next(v[i] for v in every if v[i] is not None) for i in range(len(values))]
    return jax.tree.unflatten(treedef, values)


def from_host(value, sharding) -> jax.Array:
    """A host value (the same on every process) as an array of `sharding`, each process placing its own shards: works
    for any layout, where a `device_put` onto a mesh spanning processes is refused (a jax array) or can build a
    broken array (jax 0.10, a one-device array onto a mesh with one device a process)."""
    value = np.asarray(value)  # the dtype is passed: a process holding none of the devices has no shard to tell it
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)


def owning_processes(x) -> set[int]:
    """The processes whose devices hold the array `x` ({this process} for a host value)."""
    if isinstance(x, jax.Array):
        return {d.process_index for d in x.sharding.device_set}
    return {jax.process_index()}


def without_local_shards(shape, dtype, sharding) -> jax.Array:
    """An array of `sharding` on a process that holds none of its devices: it has no data here, and the processes
    that hold its devices make it with theirs (every process builds the same global array)."""
    if any(d.process_index == jax.process_index() for d in sharding.device_set):
        raise ValueError(f"this process holds devices of {sharding}: place a value there (from_host)")
    # a fully replicated layout calls the callback once even when no device is local (its value then goes nowhere)
    return jax.make_array_from_callback(tuple(shape), sharding, lambda index: np.zeros((0,), dtype), dtype=dtype)


@functools.lru_cache(maxsize=64)
def _replicated(sharding):
    return jax.jit(lambda x: x, out_shardings=NamedSharding(sharding.mesh, PartitionSpec()))


def local_meshes(meshes) -> list:
    """The meshes of `meshes` whose devices all belong to this process; ValueError naming a mesh that spans
    processes (a rollout replica is driven by the one process its devices belong to)."""
    mine = []
    for index, mesh in enumerate(meshes):
        owners = {d.process_index for d in mesh.devices.flat}
        if len(owners) > 1:
            raise ValueError(f"replica {index} spans processes {sorted(owners)}: a rollout replica must lie within "
                             "one host; make rollout.replica no larger than a host's devices "
                             f"({jax.local_device_count()}) and the rollout group a whole number of replicas per host")
        if owners == {jax.process_index()}:
            mine.append(mesh)
    return mine


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (e.g. until process 0 has written a file the others read);
    nothing in a single process."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def on_tpu_pod(environ=os.environ) -> bool:
    """A TPU pod's host: `TPU_WORKER_HOSTNAMES` lists more than one host (a single-host TPU VM, or a benchmark that
    sets "localhost" for libtpu, lists one), or a multi-slice `MEGASCALE_COORDINATOR_ADDRESS` is set."""
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    return len(hosts) > 1 or bool(environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def multihost_flag(argv) -> bool | None:
    """The `--multihost` flag's value in `argv` (absl spellings: --multihost, --multihost=false, --nomultihost);
    None when absent. Read before absl parses the flags, as multi-process JAX must start first."""
    flag = None
    for arg in argv[1:]:
        name, _, value = arg.lstrip("-").partition("=")
        if name == "multihost":
            flag = value.lower() not in ("false", "0", "no") if value else True
        elif name == "nomultihost":
            flag = False
    return flag


def initialize_for_main(argv, environ=os.environ) -> str:
    """Start multi-process JAX for `mercury_jax.main` before anything touches a device; returns how ("" when not):
    "environment" (`ENV` set: N processes on one machine), "detected" (`--multihost`, or a TPU pod, `on_tpu_pod`:
    `jax.distributed.initialize()` finds the coordinator itself). `--nomultihost` / `--multihost=false` turn it off."""
    flag = multihost_flag(argv)
    if flag is False:
        return ""
    heartbeat_timeout_s = peer_watch.jax_heartbeat_timeout_s(peer_watch.timeout_from_argv(argv, environ))
    if initialize_from_env(environ, heartbeat_timeout_s=heartbeat_timeout_s):
        return "environment"
    if flag or on_tpu_pod(environ):
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
        return "detected"
    return ""
