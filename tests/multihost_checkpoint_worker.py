"""One process of `test_checkpoint_roles.py`: 2 CPU devices of a 5-process JAX (a stand-in for the released
`consecutive` layout: rollout on process 0, the actor on processes 1-2, the critic on processes 3-4), run as

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=5 JAX_PROCESS_ID=i \
        python tests/multihost_checkpoint_worker.py WORKDIR

Every process builds the same state (actor and critic params fsdp-sharded over their role's 4 devices, an Adam-like
moment, a replicated step count), checkpoints it at steps 1 and 2 (async) with `Checkpointer`, then a fresh
`Checkpointer` restores the latest step into the same shardings. Prints one JSON line: the layout, the shards it
holds after the restore against the values saved, and the step restored.
"""
from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.parallel.distributed import initialize_from_env
from mercury_jax.runs.checkpoints import Checkpointer, checkpoint_layout

ROLES = {"actor": (2, 6), "critic": (6, 10)}  # devices [start, stop) of jax.devices(): 2 processes each


def values(role: str, step: int) -> dict[str, np.ndarray]:
    base = 100.0 * (role == "critic") + step
    return {"w": np.arange(32, dtype=np.float32).reshape(8, 4) + base, "m": np.full((8,), base, np.float32),
            "count": np.asarray(step, np.int32)}


def state(step: int) -> dict:
    out = {}
    for role, (start, stop) in ROLES.items():
        mesh = Mesh(np.asarray(jax.devices()[start:stop]), ("fsdp",))
        specs = {"w": PartitionSpec("fsdp"), "m": PartitionSpec("fsdp"), "count": PartitionSpec()}
        out[role] = {}
        for name, value in values(role, step).items():
            sharding = NamedSharding(mesh, specs[name])
            out[role][name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i],
                                                           dtype=value.dtype)
    return out


def main(workdir: str) -> None:
    initialize_from_env()  # before any device is touched: every process of the run joins first
    layout = checkpoint_layout(state(0))
    checkpointer = Checkpointer(workdir, save_every=1, keep=5, async_save=True, layout=layout)
    for step in (1, 2):
        checkpointer.save(step, state(step), {"step": step})
    checkpointer.close()

    fresh = Checkpointer(workdir, save_every=1, keep=5, async_save=True, layout=layout)
    arrays, meta = fresh.restore_latest(state(0))
    fresh.close()
    shards = mismatched = 0
    for role in ROLES:
        expected = values(role, meta["step"])
        for name, array in arrays[role].items():
            assert array.sharding == state(0)[role][name].sharding
            for shard in array.addressable_shards:
                shards += 1
                mismatched += not np.array_equal(np.asarray(shard.data), expected[name][shard.index])
    print(json.dumps({"process": jax.process_index(), "layout": layout.kind, "primaries": layout.primaries,
                      "step": meta["step"], "shards": shards, "mismatched": mismatched}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
