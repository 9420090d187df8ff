"""The multi-process pieces in one process: what they do where every device is local, and the device split and
flag parsing they rely on (the 2-process runs are tests/test_multihost_train.py and test_multihost_publish.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.parallel import make_mesh
from mercury_jax.parallel.distributed import fetch, initialize_for_main, local_meshes, multihost_flag, on_tpu_pod
from mercury_jax.rollout.sharded_runner import ShardedRunner
from mercury_jax.train.placement import batch_to_mesh, device_groups


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def test_per_process_groups_take_a_share_of_every_process():
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    groups = device_groups({"rollout": 4, "actor": 2, "critic": 2}, devices, "per_process")
    assert [d.id for d in groups["rollout"]] == [0, 1, 4, 5]
    assert [d.id for d in groups["actor"]] == [2, 6] and [d.id for d in groups["critic"]] == [3, 7]
    consecutive = device_groups({"rollout": 4, "actor": 2, "critic": 2}, devices)
    assert [d.id for d in consecutive["rollout"]] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple of 2"):
        device_groups({"rollout": 3, "actor": 2}, devices, "per_process")
    with pytest.raises(ValueError, match="process 0 has 4"):
        device_groups({"rollout": 8, "actor": 2}, devices, "per_process")
    with pytest.raises(ValueError, match="device_layout 'spread'"):
        device_groups({"rollout": 4}, devices, "spread")


def test_multihost_flag_spellings():
    assert multihost_flag(["main"]) is None
    assert multihost_flag(["main", "--multihost"]) is True
    assert multihost_flag(["main", "--multihost=false"]) is False
    assert multihost_flag(["main", "--nomultihost", "--config", "x.py"]) is False
    # off, or nothing in the environment: no jax.distributed start (this process has already touched its devices)
    assert initialize_for_main(["main", "--nomultihost"], environ={"JAX_COORDINATOR_ADDRESS": "x:1"}) == ""
    assert initialize_for_main(["main"], environ={}) == ""
    # one host listed (a single-host TPU VM, or the AOT benchmarks' "localhost" for libtpu): not a pod
    assert initialize_for_main(["main"], environ={"TPU_WORKER_HOSTNAMES": "localhost"}) == ""
    assert on_tpu_pod({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}) and not on_tpu_pod({})


def test_batch_rows_are_placed_from_the_host_batch():
    mesh = make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    tokens = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
    placed = batch_to_mesh({"tokens": tokens}, mesh)["tokens"]
    assert placed.sharding.spec == PartitionSpec(("data", "fsdp", "expert"))
    np.testing.assert_array_equal(np.asarray(placed), tokens)
    assert [s.data.shape for s in placed.addressable_shards] == [(2, 6)] * 4


def test_fetch_is_device_get_where_everything_is_local():
    mesh = make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, PartitionSpec("fsdp")))
    out = fetch({"x": x, "n": 3, "s": jnp.float32(2.5)})
    np.testing.assert_array_equal(out["x"], np.arange(8.0))
    assert out["n"] == 3 and out["s"] == 2.5
    assert local_meshes([mesh]) == [mesh]


class RecordingRunner:
    def __init__(self):
        self.calls = []

    def run(self, tasks, *, episode_ids):
        self.calls.append((list(tasks), list(episode_ids)))
        return [f"trajectory of {t} as episode {e}" for t, e in zip(tasks, episode_ids)]


def test_sharded_runner_keeps_global_episode_ids_and_task_order():
    runner = ShardedRunner(RecordingRunner(), owners=[0, 0, 0])
    out = runner.run(["a", "b", "c", "d"], first_episode_id=10)
    assert out == [f"trajectory of {t} as episode {10 + i}" for i, t in enumerate("abcd")]
    assert runner.calls == [(["a", "b", "c", "d"], [10, 11, 12, 13])]  # the local runner's attributes show through


def test_sharded_runner_names_episodes_no_process_ran():
    """Replica 1 belongs to process 1, which does not exist here: its episodes come back from nobody."""
    runner = ShardedRunner(RecordingRunner(), owners=[0, 1])
    with pytest.raises(RuntimeError, match=r"episodes \[1, 3\] came back from no process"):
        runner.run(["a", "b", "c", "d"])
    assert runner.calls == [(["a", "c"], [0, 2])]
