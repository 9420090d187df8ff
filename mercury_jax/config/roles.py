"""The roles' device groups and meshes as a config names them: how many devices a role has (`config.devices`; the
GRPO reference shares the actor's), its mesh's axis sizes (`config.mesh.<role>`), how many ways it splits a batch's
rows, and the rollout side's replica layout. Pure arithmetic on the config: `train/placement.py` builds the meshes,
`config/validate.py` checks them, the benches read them."""
from __future__ import annotations

from collections.abc import Mapping

import ml_collections
import numpy as np

from mercury_jax.config.defaults import setting
from mercury_jax.parallel import mesh_axis_sizes

ROW_AXES = ("data", "fsdp", "expert")
SEQUENCE_AXIS = "sequence"  # a row's positions (models/qwen35_moe/row_split.py)
GROUP_ORDER = ("rollout", "actor", "critic")  # the device groups' order on the device list (a ConfigDict sorts keys)
DEVICE_GROUP_OF = {"reference": "actor"}  # a role without a device group of its own shares this one's devices
DEVICE_LAYOUTS = ("consecutive", "per_process")  # how the groups take devices (config.device_layout)


def role_devices(config, role: str) -> int:
    """The number of devices of `role` (every group 0: 1, the shared default device)."""
    groups = dict(config.devices)
    return groups[DEVICE_GROUP_OF.get(role, role)] if any(groups.values()) else 1


def role_mesh_sizes(config, role: str, num_devices: int | None = None) -> dict[str, int]:
    """The axis sizes of `role`'s mesh (`config.mesh.<role>`; a role without an entry, e.g. the rollout side: fsdp
    over its group); ValueError naming the role, its shape and its device count when they do not fit."""
    num_devices = role_devices(config, role) if num_devices is None else num_devices
    shape = dict(config.mesh[role]) if "mesh" in config and role in config.mesh else {"fsdp": -1}
    try:
        return mesh_axis_sizes(shape, num_devices)
    except ValueError as error:
        raise ValueError(f"mesh.{role} {shape} does not fit the {role} role's {num_devices} device(s) ({error}); "
                         f"make the axis sizes multiply to {num_devices}, or set one of them to -1") from None


def row_shards(sizes: Mapping[str, int]) -> int:
    """How many ways a batch's rows are split on a mesh of axis `sizes` (`mesh.shape`): the product of `ROW_AXES`."""
    return int(np.prod([sizes[axis] for axis in ROW_AXES]))


def rollout_layout(rollout: ml_collections.ConfigDict | None) -> tuple[dict, str | None]:
    """(one replica's mesh shape, {} for a single engine; the rollout weights' dtype, None for the learner's) of a
    config's `rollout` section (None: no section)."""
    return dict(setting(rollout, "replica") or {}), setting(rollout, "param_dtype") or None
