"""One process of `test_multihost_publish.py`: 4 CPU devices of a 2-process JAX, run as

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i python tests/multihost_publish_worker.py

The learner's params lie on process 1's 4 devices (fsdp), two rollout replicas of 2 devices (tensor) on process 0's.
Both processes publish with `rollout.publish.Publisher`; each checks the replica shards it holds against the bf16 cast
of the same values, then tries a plain `jax.device_put` of the params into a replica's layout, then all-gathers a
Python object of its own (`parallel.distributed.all_gather_objects`). Prints one JSON line.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mercury_jax.parallel import make_mesh, param_shardings
from mercury_jax.parallel.distributed import all_gather_objects, initialize_from_env
from mercury_jax.rollout.layout import replica_meshes
from mercury_jax.rollout.publish import Publisher
from models.qwen35_moe import Qwen35MoeForCausalLM
from models.qwen35_moe import config as C


def main():
    initialize_from_env()  # before any device is touched: every process of the run joins first
    devices = jax.devices()
    model = Qwen35MoeForCausalLM(C.tiny(vocab_size=80, num_hidden_layers=4), rngs=nnx.Rngs(3))
    _, params = nnx.split(model)
    host, treedef = jax.tree.flatten(jax.tree.map(np.asarray, params))  # the same values on both processes
    learner = make_mesh({"fsdp": -1}, devices=devices[4:8])
    placed = jax.tree.unflatten(treedef, [
        jax.make_array_from_callback(a.shape, s, lambda index, a=a: a[index], dtype=a.dtype)
        for a, s in zip(host, jax.tree.leaves(param_shardings(params, learner)))])
    meshes = replica_meshes(devices[:4], {"tensor": 2})
    publisher = Publisher(meshes, "bfloat16")
    published = publisher(placed)
    checked = mismatched = 0
    for tree in published:
        for leaf, value in zip(jax.tree.leaves(tree), host):
            for shard in leaf.addressable_shards:
                expected = np.asarray(jnp.asarray(value[shard.index]).astype(jnp.bfloat16))
                mismatched += not np.array_equal(np.asarray(shard.data).view(np.uint16), expected.view(np.uint16))
                checked += 1
    try:
        jax.block_until_ready(jax.device_put(placed, param_shardings(placed, meshes[0])))
        plain = "accepted"
    except Exception as error:  # noqa: BLE001 (the refusal is the finding)
        plain = f"refused: {type(error).__name__}"
    mine = {"process": jax.process_index(), "items": list(range(3 + 5 * jax.process_index()))}  # unequal sizes
    gathered = all_gather_objects(mine)
    print(json.dumps({"gathered": gathered, "process": jax.process_index(), "processes": jax.process_count(),
                      "devices": len(devices),
                      "local_devices": jax.local_device_count(), "supports": publisher.supports(placed),
                      "checked_shards": checked, "mismatched_shards": mismatched, "device_put": plain}), flush=True)


if __name__ == "__main__":
    main()
