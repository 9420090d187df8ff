"""Where the trainers' arrays live: one mesh per role, and batches / optimiser leaves placed on it.

Roles sit on device groups (`config.devices`: rollout, actor, critic; all 0 = every role on the default device);
the GRPO `reference` shares the actor's devices. `config.device_layout` says how the groups take devices:
"consecutive" slices of `jax.devices()` in `GROUP_ORDER` (process-ordered, so on a pod each group is whole hosts),
or "per_process" (each group takes size / P devices of every one of the P processes: every group spans every host,
as the multi-process tests run it). Each learner role's mesh has the axes (data,
fsdp, expert, tensor) with the sizes of `config.mesh.<role>` (one -1 takes the rest of the group). A batch's rows
are split over (data, fsdp, expert) (`ROW_AXES`, as the MoE dispatches tokens from their own shard) and repeated
over tensor, which splits heads and hidden units instead.

Every input of a jitted learner step must have the same layout at every step, or the step compiles again: the
optimiser's step counts start uncommitted on the default device, so `onto_mesh` replicates them over the group's
mesh before the first step, and `make_update_step(..., state_shardings=shardings_of(...))` pins the step's
outputs to its inputs' layout (XLA may otherwise name an equal layout differently, P() for P(None, None)).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.config.defaults import setting
from mercury_jax.config.roles import (
    DEVICE_GROUP_OF,
    DEVICE_LAYOUTS,
    GROUP_ORDER,
    ROW_AXES,
    SEQUENCE_AXIS,
    role_mesh_sizes,
)
from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.parallel.distributed import from_host
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.state import TrainState


def role_meshes(config, roles: Iterable[str], devices=None) -> dict:
    """A mesh per role over its device group (consecutive slices of `devices`, default `jax.devices()`, in
    `GROUP_ORDER`), shaped by `role_mesh_sizes`."""
    groups = {name: config.devices[name] for name in sorted(config.devices, key=GROUP_ORDER.index)}
    devices = jax.devices() if devices is None else list(devices)
    layout = setting(config, "device_layout")
    devices = device_groups(groups, devices, layout) if any(groups.values()) else {g: devices[:1] for g in groups}
    return {role: make_mesh(role_mesh_sizes(config, role), devices=devices[DEVICE_GROUP_OF.get(role, role)])
            for role in roles}


def device_groups(sizes: dict[str, int], devices=None, layout: str = "consecutive") -> dict[str, list]:
    """Split `devices` (default `jax.devices()`) into named groups, e.g. {"rollout": 4, "actor": 2, "critic": 2}:
    consecutive slices, or with `layout="per_process"` each group's size / P devices from each of the P processes
    (in process order)."""
    devices = jax.devices() if devices is None else list(devices)
    if layout not in DEVICE_LAYOUTS:
        raise ValueError(f"device_layout {layout!r} is not one of {DEVICE_LAYOUTS}")
    if layout == "per_process":
        return _per_process_groups(sizes, devices)
    if sum(sizes.values()) > len(devices):
        raise ValueError(f"device groups {dict(sizes)} need {sum(sizes.values())} devices but only "
                         f"{len(devices)} exist; shrink the groups in config.devices")
    groups, start = {}, 0
    for name, size in sizes.items():
        groups[name] = devices[start:start + size]
        start += size
    return groups


def _per_process_groups(sizes: dict[str, int], devices: list) -> dict[str, list]:
    by_process: dict[int, list] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    count = len(by_process)
    uneven = {name: size for name, size in sizes.items() if size % count}
    if uneven:
        raise ValueError(f"device_layout 'per_process': groups {uneven} do not split evenly over {count} processes; "
                         f"make every group in config.devices a multiple of {count}")
    groups = {name: [] for name in sizes}
    for process, local in sorted(by_process.items()):
        shares = {name: size // count for name, size in sizes.items()}
        if sum(shares.values()) > len(local):
            raise ValueError(f"device groups {dict(sizes)} take {sum(shares.values())} devices of each process but "
                             f"process {process} has {len(local)}; shrink the groups in config.devices")
        start = 0
        for name, share in shares.items():
            groups[name] += local[start:start + share]
            start += share
    return groups

def onto_mesh(tree, mesh):
    """Leaves not placed on `mesh` by name (tx.init's step counts) replicated over it; the rest untouched."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def on_mesh(x):
        return isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh

    return jax.tree.map(lambda x: x if on_mesh(x) else from_host(x, replicated), tree)


def state_on_mesh(model: nnx.Module, optimizer_cfg, mesh, trainable=nnx.Param) -> TrainState:
    """`model` sharded over `mesh` by its logical axes (in place) as a `TrainState` whose optimiser state lives on
    the mesh too (before a restore would commit it to device 0)."""
    shard_params(model, mesh)
    state = TrainState.create(model, make_optimizer(optimizer_cfg), trainable)
    state.frozen, state.opt_state = onto_mesh((state.frozen, state.opt_state), mesh)
    return state


def step_shardings(state: TrainState):
    """The layout a learner step's (params, opt_state) outputs are pinned to: its inputs'."""
    return shardings_of((state.params, state.opt_state))


def batch_sharding(mesh, shape) -> NamedSharding:
    """Where a learner batch array of `shape` [B, ...] lives on `mesh`: rows over `ROW_AXES`, and a [B, T, ...]'s
    positions over 'sequence' when that axis splits rows (size > 1, dividing T), as the model has them
    (models/qwen35_moe/row_split.py)."""
    positions = mesh.shape.get(SEQUENCE_AXIS, 1)
    if positions > 1 and len(shape) >= 2 and shape[1] % positions == 0:
        return NamedSharding(mesh, PartitionSpec(ROW_AXES, SEQUENCE_AXIS))
    return NamedSharding(mesh, PartitionSpec(ROW_AXES))


def batch_to_mesh(batch: Mapping, mesh) -> dict:
    """Host arrays [B, ...] onto `mesh` by `batch_sharding`. Every process holds the whole batch (in a multi-process
    run the trajectories reach every host, `rollout/sharded_runner.py`) and places the rows of its own devices."""
    return {k: from_host(v, batch_sharding(mesh, np.shape(v))) for k, v in batch.items()}


def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def device_copy(model, device):
    """A copy of `model` on `device` that never aliases its buffers (learner steps donate theirs)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, device, may_alias=False))
