"""How a checkpoint's arrays are laid out over the processes, and the Orbax items that save each layout.

Orbax saves a `jax.Array` in a multi-process run only when every process holds a shard of it: a process with none
fails in its shard bookkeeping, and an array within one process is refused as "host local". The learner roles of
the released `consecutive` layout live on some hosts only (actor on 8 of a pod's 32, critic on 8 others). Three
layouts, from the arrays' shardings alone (the same answer on every process):

- `"global"`: one process, or every array has shards on every process: the standard `arrays` item.
- `"roles"`: every top-level part of the tree (a role: "actor", "critic", "policy", ...) lies on a set of two or more
  processes that holds a shard of each of its arrays. Each part is its own item, `arrays_<part>`, whose primary
  process is the lowest of that set: it writes the item's metadata and the arrays' zarr metadata, and every process
  writes and reads the shards it holds and skips the arrays it holds none of (`ShardsHeldHere`). Nothing passes
  through a host copy of the whole state: each learner host writes its own shards, as on `global`.
- `"host_copies"`: anything else (a role within one process, as in the tests' 2-host layouts): the arrays are
  fetched to every process and process 0 writes them as one `arrays` item. That costs a host copy of the whole
  state, which a learner within one host has room for.

The items are ordinary Orbax PyTree items: `run_reader.read_checkpoint_arrays` and the export
(`checkpoint_tensors.py`) read either form.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.metadata import array_metadata_store  # no public path to these two in orbax 0.12
from orbax.checkpoint._src.serialization.type_handler_registry import create_type_handler_registry

from mercury_jax.parallel.distributed import owning_processes, without_local_shards

ARRAYS_ITEM = "arrays"
ROLE_ITEM_PREFIX = "arrays_"


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    kind: str                               # "global", "roles" or "host_copies"
    primaries: dict[str, int] = dataclasses.field(default_factory=dict)  # roles: part -> its primary process


def is_arrays_item(name: str) -> bool:
    """Whether a step directory's entry `name` is an array item (`arrays`, or a role's `arrays_<part>`)."""
    return name == ARRAYS_ITEM or name.startswith(ROLE_ITEM_PREFIX)


def checkpoint_layout(arrays: Any) -> CheckpointLayout:
    """The layout of `arrays` (a dict of parts) over the processes (module docstring)."""
    everyone = set(range(jax.process_count()))
    leaves = jax.tree.leaves(arrays)
    if len(everyone) == 1 or all(isinstance(x, jax.Array) and owning_processes(x) == everyone for x in leaves):
        return CheckpointLayout("global")
    if not isinstance(arrays, dict) or not all(isinstance(x, jax.Array) for x in leaves):
        return CheckpointLayout("host_copies")
    primaries = {}
    for part, subtree in arrays.items():
        owners = [owning_processes(x) for x in jax.tree.leaves(subtree)]
        holders = set.intersection(*owners) if owners else set()
        if not holders or any(len(o) < 2 for o in owners):
            return CheckpointLayout("host_copies")
        primaries[str(part)] = min(holders)
    return CheckpointLayout("roles", primaries)


class ShardsHeldHere(type_handlers.ArrayHandler):
    """Orbax's `jax.Array` handler for arrays that lie on some of the processes: a process writes and reads the
    shards it holds and skips the arrays it holds none of (it builds those as arrays with no local shards)."""

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        held = [i for i, value in enumerate(values) if value.addressable_shards]
        if not held:
            return []
        return await super().serialize([values[i] for i in held], [infos[i] for i in held],
                                       [args[i] for i in held])

    async def deserialize(self, infos, args=None):
        held = [i for i, arg in enumerate(args) if arg.sharding.addressable_devices]
        restored = (await super().deserialize([infos[i] for i in held], [args[i] for i in held])) if held else []
        out = dict(zip(held, restored))
        return [out[i] if i in out else
                without_local_shards(arg.global_shape, arg.dtype, arg.sharding)
                for i, arg in enumerate(args)]


def role_item_handler(primary: int) -> ocp.PyTreeCheckpointHandler:
    """The PyTree handler of one role's item: metadata from `primary`, shards from the processes that hold them."""
    registry = create_type_handler_registry(
        (jax.Array, ShardsHeldHere(primary_host=primary, array_metadata_store=array_metadata_store.Store())))
    return ocp.PyTreeCheckpointHandler(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=primary),
        type_handler_registry=registry)


def save_args(layout: CheckpointLayout, arrays: Any) -> dict:
    """The Composite arguments of the array items."""
    if layout.kind != "roles":
        return {ARRAYS_ITEM: ocp.args.StandardSave(arrays)}
    return {ROLE_ITEM_PREFIX + part: ocp.args.PyTreeSave(arrays[part]) for part in layout.primaries}


def restore_args(layout: CheckpointLayout, abstract_arrays: Any) -> dict:
    """The Composite arguments that restore the array items into the shardings of `abstract_arrays`."""
    if layout.kind != "roles":
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_arrays)
        return {ARRAYS_ITEM: ocp.args.StandardRestore(target)}
    args = {}
    for part in layout.primaries:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_arrays[part])
        args[ROLE_ITEM_PREFIX + part] = ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    return args


def restored_arrays(layout: CheckpointLayout, restored) -> Any:
    if layout.kind != "roles":
        return restored[ARRAYS_ITEM]
    return {part: restored[ROLE_ITEM_PREFIX + part] for part in layout.primaries}
