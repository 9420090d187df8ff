"""Orbax checkpoints of a whole training state: arrays (weights, optimiser states, RNG) plus JSON metadata
(step, data-iterator state, metric history), saved asynchronously every N steps, keeping the last K.

Resuming restores the arrays into the shapes/shardings of a freshly built state, so a killed run continues with
the same weights, optimiser moments, RNG and data order. A preemption request (`preemption.py`) makes the next
`should_save` true; the loops never save a non-finite state (`guards.py` stops or skips the step first).
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from mercury_jax.train import preemption
from mercury_jax.train.rundir import RunDir


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, *, save_every: int, keep: int, async_save: bool = True):
        self.directory = RunDir(directory).root  # absolute when local (Orbax resolves nothing relative), or a URI
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._closed = False

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, *, last: bool = False) -> bool:
        """Every `save_every` steps, at the last step, and after any step once a preemption was requested."""
        return last or preemption.requested() or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, arrays: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                        meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_arrays: Any) -> tuple[Any, dict]:
        """Arrays restored into the structure, dtypes and shardings of `abstract_arrays`, and the metadata."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_arrays)
        restored = self.manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(target),
                                                                      meta=ocp.args.JsonRestore()))
        return restored["arrays"], restored["meta"]

    def close(self) -> None:
        """Wait for the saves in flight (their steps become restorable) and release the manager; idempotent."""
        if not self._closed:
            self._closed = True
            self.manager.wait_until_finished()
            self.manager.close()

    def close_after_error(self) -> None:
        """`close` while another exception is on its way out (a non-finite step, a preemption, a failure): the last
        good step being saved still gets committed, and a failure to do so is printed, not raised over that one."""
        try:
            self.close()
        except Exception as error:  # noqa: BLE001
            print(f"checkpointer {self.directory}: closing after an error failed with {type(error).__name__}: "
                  f"{error}", flush=True)
