"""A checkpoint's policy read array by array, or one row of a stacked array at a time, through tensorstore.

An Orbax item (`arrays`, or a role's own `arrays_actor`) is a key-value store (OCDBT, unless the item says
otherwise) of zarr arrays, one per leaf, each keyed by its leaf's dotted name (`actor.params.model.embed.value`).
`run_reader.item_tree` gives every leaf's name, shape and dtype without reading data; `CheckpointTensors` opens an
array when it is first asked for and reads the part asked for. Tensorstore decodes the chunks that part touches and
keeps none of them (no chunk cache): a one-device save stores a leaf as one chunk, so reading one row of a
stacked leaf decodes the leaf's chunk once more. Host memory is bounded by the largest checkpoint array (its
compressed and decoded chunk) plus the part read, whatever the model's size.

`CheckpointTensors` is a `models.qwen35_moe.hf_tensors.ArraySource`: `write_hf` exports a checkpoint straight
from it (`mercury_jax.export`). Local items and `gs://` items read alike (the item directory is an epath).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import tensorstore as ts
from etils import epath
from flax import nnx

from mercury_jax.runs.run_reader import (
    PolicyItem,
    RunReader,
    RunReadError,
    check_policy_arrays,
    damaged_item,
    item_tree,
    leaf_name,
)


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """Where one checkpoint array lies: its Orbax item, its key in the item's store, shape and dtype."""
    item: epath.Path
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype


def stored_arrays(item: PolicyItem) -> dict[tuple[str, ...], StoredArray]:
    """The arrays under `item.subtree`, keyed by their name below it (nnx `value` leaves named by their variable),
    from the item's metadata alone."""
    tree = item_tree(item.directory)
    for key in item.subtree:
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    return {leaf_name(path): StoredArray(item.directory, meta.name, tuple(meta.shape), np.dtype(meta.dtype))
            for path, meta in jax.tree_util.tree_flatten_with_path(tree)[0]}


def item_storage(item: epath.Path) -> tuple[bool, bool]:
    """(use_ocdbt, use_zarr3) of an Orbax item, from its `_METADATA` (Orbax's defaults when it says nothing)."""
    metadata = json.loads((item / "_METADATA").read_text())
    return bool(metadata.get("use_ocdbt", True)), bool(metadata.get("use_zarr3", False))


def zarr_spec(array: StoredArray, use_ocdbt: bool, use_zarr3: bool) -> dict:
    """The tensorstore spec that opens `array` for reading."""
    where = os.fspath(array.item)
    base = where.rstrip("/") + "/" if "://" in where else {"driver": "file",
                                                           "path": os.path.abspath(where) + "/"}
    if use_ocdbt:
        kvstore = {"driver": "ocdbt", "base": base, "path": array.key}
    elif isinstance(base, dict):
        kvstore = {**base, "path": base["path"] + array.key + "/"}
    else:
        kvstore = base + array.key + "/"
    return {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore}


class CheckpointTensors:
    """The policy of checkpoint `step` of a run's `stage`, read on demand (an `ArraySource`: `read(name, index,
    dtype)`). Built by `open`, which checks the stored names and shapes against the run's model first."""

    def __init__(self, arrays: dict[tuple[str, ...], StoredArray], unreadable):
        self.arrays = arrays
        self._unreadable = unreadable  # error -> the RunReadError that names the step and the fix
        self._context = ts.Context()
        self._stores: dict[tuple[str, ...], ts.TensorStore] = {}
        self._storage: dict[str, tuple[bool, bool]] = {}

    @classmethod
    def open(cls, reader: RunReader, stage: str, step: int, model=None) -> CheckpointTensors:
        """The checkpoint's policy arrays, checked against `model` (default `reader.abstract_policy()`): every
        parameter present with its shape, nothing else. Errors are `RunReadError`s in `restore_policy`'s words."""
        model = reader.abstract_policy() if model is None else model
        wanted = {tuple(str(k) for k in path): variable for path, variable in nnx.to_flat_state(nnx.state(model))}

        def unreadable(error: RunReadError) -> RunReadError:
            return reader.unreadable_step(stage, step, error)

        arrays, item = {}, None
        try:
            for item in reader.policy_items(stage, step):
                arrays.update(stored_arrays(item))
        except RunReadError as error:
            raise unreadable(error) from None
        where = os.fspath(item.directory) if item else os.fspath(reader.checkpoints(stage) / str(step))
        check_policy_arrays(where, wanted, {name: array.shape for name, array in arrays.items()})
        return cls(arrays, unreadable)

    def __call__(self, name: tuple[str, ...], index: int | None, dtype) -> np.ndarray:
        """Array `name` (row `index` of its leading axis unless None) as a host array in `dtype` (None: stored)."""
        array = self.arrays[name]
        try:
            with damaged_item(array.item):
                store = self._store(name, array)
                value = (store if index is None else store[index]).read().result()
        except RunReadError as error:
            raise self._unreadable(error) from None
        return value if dtype is None else value.astype(dtype, copy=False)

    def _store(self, name: tuple[str, ...], array: StoredArray) -> ts.TensorStore:
        if name not in self._stores:
            where = os.fspath(array.item)
            if where not in self._storage:
                self._storage[where] = item_storage(array.item)
            spec = zarr_spec(array, *self._storage[where])
            self._stores[name] = ts.open(spec, open=True, read=True, context=self._context).result()
        return self._stores[name]
