"""Orbax checkpoints of a whole training state: arrays (weights, optimiser states, RNG) plus JSON metadata
(step, data-iterator state, metric history), saved asynchronously every N steps, keeping the last K.

Resuming restores the arrays into the shapes/shardings of a freshly built state, so a killed run continues with
the same weights, optimiser moments, RNG and data order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, *, save_every: int, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, *, last: bool = False) -> bool:
        return last or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, arrays: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                        meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_arrays: Any) -> tuple[Any, dict]:
        """Arrays restored into the structure, dtypes and shardings of `abstract_arrays`, and the metadata."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_arrays)
        restored = self.manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(target),
                                                                      meta=ocp.args.JsonRestore()))
        return restored["arrays"], restored["meta"]

    def restore_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
