"""Where the trainers' arrays live: one mesh per device group, and batches / optimiser leaves placed on it.

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

from mercury_jax.parallel import make_mesh, shard_params
from mercury_jax.train import setup
from mercury_jax.train.optim import make_optimizer
from mercury_jax.train.state import TrainState


def group_meshes(devices: Mapping[str, int], names: Iterable[str]) -> dict:
    """A mesh per named device group (`fsdp` over the group's devices); all sizes 0: every group on device 0."""
    sizes = {name: devices[name] for name in names}
    if sum(sizes.values()) == 0:
        device = jax.devices()[0]
        return {name: make_mesh({}, devices=[device]) for name in sizes}
    groups = setup.device_groups(sizes)
    return {name: make_mesh({"fsdp": len(group)}, devices=group) for name, group in groups.items()}


def onto_mesh(tree, mesh):
    """Leaves not placed on `mesh` by name (tx.init's step counts) replicated over it; the rest untouched."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def on_mesh(x):
        return isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh

    return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, replicated), tree)


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


def batch_to_mesh(batch: Mapping, mesh) -> dict:
    """Host arrays [B, ...] onto `mesh`, rows split over (data, fsdp)."""
    sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    return {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}


def shardings_of(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def device_copy(model, device):
    """A copy of `model` on `device` that never aliases its buffers (learner steps donate theirs)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, device, may_alias=False))
