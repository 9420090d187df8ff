"""The layout rule of a checkpoint's arrays (`checkpoint_layout`, mercury_jax/runs/checkpoint_roles.py) in one process,
with the owning processes faked: the test's 8 CPU devices stand for 4 processes of 2 devices each. A role that lies on
two or more processes is its own item, written first by the lowest of them; a role within one process, a role whose
arrays share no process, or a leaf that is not a `jax.Array` makes the whole state a host copy; arrays on every
process (or one process in all) are the plain `arrays` item. tests/test_checkpoint_roles.py saves and restores the
role items on 5 real processes."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mercury_jax.runs import checkpoint_roles
from mercury_jax.runs.checkpoint_roles import CheckpointLayout, checkpoint_layout

PROCESSES = 4
# device index -> its fake process: 0 0 1 1 2 2 3 3
PROCESS_OF_DEVICE = {i: i // 2 for i in range(8)}


@pytest.fixture(autouse=True)
def four_processes(monkeypatch):
    """`jax.process_count()` is 4 and an array's owning processes are those of its devices in PROCESS_OF_DEVICE."""
    devices = jax.devices()
    process_of = {devices[i].id: process for i, process in PROCESS_OF_DEVICE.items()}
    monkeypatch.setattr(checkpoint_roles.jax, "process_count", lambda: PROCESSES)
    monkeypatch.setattr(checkpoint_roles, "owning_processes",
                        lambda x: {process_of[d.id] for d in x.sharding.device_set})


def on(processes: tuple[int, ...], shape=(8, 4), sharded: bool = True) -> jax.Array:
    """An array over the devices of `processes`, split over them along its first axis (or replicated)."""
    devices = [d for i, d in enumerate(jax.devices()) if PROCESS_OF_DEVICE[i] in processes]
    mesh = Mesh(np.asarray(devices), ("fsdp",))
    spec = PartitionSpec("fsdp") if sharded else PartitionSpec()
    return jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))


def role(processes: tuple[int, ...]) -> dict:
    """A learner role's state on `processes`: split weights, a split moment, a replicated step count."""
    return {"w": on(processes), "m": on(processes, (8,)), "count": on(processes, (), sharded=False)}


def test_roles_on_two_or_more_processes_are_items_written_first_by_their_lowest_process():
    """Planted bug: `primaries[str(part)] = min(holders)` -> `max(holders)` in checkpoint_layout."""
    arrays = {"actor": role((1, 2)), "critic": role((3, 0)), "step": on((0, 1, 2, 3), (), sharded=False)}
    assert checkpoint_layout(arrays) == CheckpointLayout("roles", {"actor": 1, "critic": 0, "step": 0})


def test_a_roles_primary_holds_every_one_of_its_arrays():
    """The actor's weights lie on processes 1-2 and its moment on 2-3: only process 2 holds a shard of each.
    Planted bug: `set.intersection(*owners)` -> `set.union(*owners)` in checkpoint_layout."""
    arrays = {"actor": {"w": on((1, 2)), "m": on((2, 3), (8,))}, "critic": role((0, 3))}
    assert checkpoint_layout(arrays) == CheckpointLayout("roles", {"actor": 2, "critic": 0})


@pytest.mark.parametrize("arrays", [
    pytest.param(lambda: {"actor": role((1,)), "critic": role((2, 3))}, id="a role within one process"),
    pytest.param(lambda: {"actor": {"w": on((1,)), "m": on((2,), (8,))}, "critic": role((0, 3))},
                 id="a role whose arrays share no process"),
    pytest.param(lambda: {"actor": role((1, 2)), "critic": {"w": np.zeros((8, 4), np.float32)}},
                 id="a host value"),
    pytest.param(lambda: [role((1, 2)), role((0, 3))], id="not a dict of parts"),
])
def test_anything_else_is_one_host_copy(arrays):
    """Orbax refuses an array within one process ("host local"), so such a role is no item of its own. Planted bug:
    `if not holders or any(len(o) < 2 for o in owners):` -> `if not holders:` in checkpoint_layout."""
    assert checkpoint_layout(arrays()) == CheckpointLayout("host_copies")


def test_arrays_on_every_process_or_a_single_process_are_the_plain_item(monkeypatch):
    """Planted bug: `all(isinstance(x, jax.Array) and owning_processes(x) == everyone ...)` -> `any(...)`."""
    everywhere = {"actor": role((0, 1, 2, 3)), "critic": role((0, 1, 2, 3))}
    assert checkpoint_layout(everywhere) == CheckpointLayout("global")
    assert checkpoint_layout({"actor": role((1, 2)), "critic": role((0, 1, 2, 3))}).kind == "roles"
    monkeypatch.setattr(checkpoint_roles.jax, "process_count", lambda: 1)
    assert checkpoint_layout({"actor": role((1,)), "critic": [np.zeros(3)]}) == CheckpointLayout("global")
