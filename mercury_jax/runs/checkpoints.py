"""Orbax checkpoints of a whole training state: arrays (weights, optimiser states, RNG) plus JSON metadata
(step, data-iterator state, metric history), saved asynchronously every N steps, keeping the last K.

Resuming restores the arrays into the shapes/shardings of a freshly built state, so a killed run continues with
the same weights, optimiser moments, RNG and data order. A preemption request (`preemption.py`) makes the next
`should_save` true; the loops never save a non-finite state (`guards.py` stops or skips the step first).

Faults (`checkpoint_faults.py`):
- resume (`restore_latest`) takes the newest step that restores. A step whose files are incomplete (an empty
  directory, a missing `manifest.ocdbt`) or whose restore raises (a truncated data file) is skipped with one printed
  line; once an older step has restored, the skipped ones are renamed `STEP.corrupt-<UTC time>` (nothing is deleted;
  Orbax's step listing and `keep` no longer see them, and a new save of that step number does not collide). When no
  step restores, `CheckpointRestoreError` lists each step and why, and nothing is renamed (a state that fits none of
  them, such as a changed model shape, is a config problem, not damage).
- several processes: the file check is the same on every process, so they skip the same steps; only process 0
  renames, then all wait for it. A restore that raises on some process is not retried (the processes could not
  agree on the next step without hanging in Orbax's restore barrier): that one step is named with the fix.
- a save that fails (ENOSPC, EFBIG, permissions) raises `CheckpointSaveError` naming the step, the OS error and
  the last committed step. An async save's error comes from Orbax's background thread: it is checked right after
  the save starts, and waited for at the next save and at `close`; Orbax's logged tracebacks become one line each.
"""
from __future__ import annotations

import errno
import os
import time
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from mercury_jax.parallel.distributed import fetch, from_host
from mercury_jax.runs import preemption
from mercury_jax.runs.checkpoint_faults import (
    FIXES,
    CheckpointRestoreError,
    CheckpointSaveError,
    describe,
    errno_text,
    named_file,
    os_error,
    summarise_orbax_tracebacks,
    unreadable_reason,
)
from mercury_jax.runs.checkpoint_roles import (
    ROLE_ITEM_PREFIX,
    CheckpointLayout,
    checkpoint_layout,
    restore_args,
    restored_arrays,
    role_item_handler,
    save_args,
)
from mercury_jax.runs.rundir import RunDir


class DataLayoutChanged(ValueError):
    """A run resumed on another process count than its checkpoint's data-iterator state was saved from."""


__all__ = ["Checkpointer", "DataLayoutChanged", "CheckpointLayout", "CheckpointRestoreError", "CheckpointSaveError",
           "checkpoint_layout"]


class Checkpointer:
    """`layout`: how the checkpoint's arrays lie over the processes (`checkpoint_roles.checkpoint_layout` of the
    arrays the loop saves; None: every process holds a shard of each, one `arrays` item). The released `consecutive`
    layout keeps the learner roles on some hosts only: each role is then its own item, written and read shard by
    shard by the hosts that hold it; a role within one process goes through host copies instead (every process
    receives the arrays, `distributed.fetch`, process 0 writes them; a restore places them back from every process,
    `distributed.from_host`), which a learner within one host has room for (checkpoint_roles.py)."""

    def __init__(self, directory: str | os.PathLike, *, save_every: int, keep: int, async_save: bool = True,
                 layout: CheckpointLayout | None = None):
        self.directory = RunDir(directory).root  # absolute when local (Orbax resolves nothing relative), or a URI
        self.save_every = save_every
        self.layout = layout or CheckpointLayout("global")
        self.host_copies = self.layout.kind == "host_copies"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        summarise_orbax_tracebacks()
        handlers = None
        if self.layout.kind == "roles":
            handlers = {ROLE_ITEM_PREFIX + part: role_item_handler(primary)
                        for part, primary in self.layout.primaries.items()}
            handlers["meta"] = ocp.JsonCheckpointHandler()
            handlers["data"] = grain.checkpoint.CheckpointHandler()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._closed = False
        self._in_flight: int | None = None  # the step whose (async) save has started and not been checked
        self._failure: CheckpointSaveError | None = None
        self.data_restored = False  # whether the last restore set a data stream's position

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, *, last: bool = False) -> bool:
        """Every `save_every` steps, at the last step, and after any step once a preemption was requested."""
        return last or preemption.requested() or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, arrays: Any, meta: dict, data=None) -> None:
        """Start saving `step` (in the background when async); `CheckpointSaveError` if this save or the one before
        it failed. `data`: a data iterator's state (grain's protocol, e.g. `RowStream.snapshot()`), written by grain's
        checkpoint handler as the `data` item, one file a process."""
        if self._failure is not None:
            raise self._failure
        self._finish_in_flight()
        if self.host_copies:
            arrays = fetch(arrays)  # a collective: every process saves every step together
        try:
            items = dict(save_args(self.layout, arrays), meta=ocp.args.JsonSave(meta))
            if data is not None:
                items["data"] = grain.checkpoint.CheckpointSave(data)
            self.manager.save(step, args=ocp.args.Composite(**items))
        except Exception as error:  # noqa: BLE001 - Orbax raises ValueError for a failed tensorstore write
            raise self._save_failed(step, error) from None
        self._in_flight = step
        if not self.manager.is_saving_in_progress():  # done already: a synchronous save, or an early failure
            self._finish_in_flight()

    def restore(self, step: int, abstract_arrays: Any, data=None) -> tuple[Any, dict]:
        """Arrays restored into the structure, dtypes and shardings of `abstract_arrays`, and the metadata; `data`
        (a data iterator) set to the step's saved position when the step holds one (`data_state_of`)."""
        data_args = {} if data is None or not self.data_state_of(step) else {
            "data": grain.checkpoint.CheckpointRestore(data)}
        self.data_restored = bool(data_args)  # read by the loop's resume line
        if self.host_copies:
            # read as host arrays, whatever devices saved them (a checkpoint of another layout restores too)
            as_host = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_arrays)
            restored = self.manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(as_host),
                                                                          meta=ocp.args.JsonRestore(), **data_args))
            arrays = jax.tree.map(lambda value, x: from_host(np.asarray(value, x.dtype), x.sharding),
                                  restored["arrays"], abstract_arrays)
            return arrays, restored["meta"]
        restored = self.manager.restore(step, args=ocp.args.Composite(**restore_args(self.layout, abstract_arrays),
                                                                      meta=ocp.args.JsonRestore(), **data_args))
        return restored_arrays(self.layout, restored), restored["meta"]

    def data_state_of(self, step: int) -> bool:
        """Whether `step` holds this process's data-iterator state. A step without a `data` item (written by a run
        without a data iterator) restores without one (the data starts afresh, said in one line); one whose `data`
        item lacks this process's file was saved on another process count: `DataLayoutChanged`."""
        if not self._data_item(step):
            print(f"checkpoint step {step} in {self.directory} holds no data-iterator state; the data stream "
                  f"starts from its beginning", flush=True)
            return False
        return True

    def _data_item(self, step: int) -> bool:
        """Whether `step` has a `data` item; `DataLayoutChanged` when it lacks this process's file."""
        item = self.directory / str(step) / "data"
        if not item.exists():
            return False
        mine = item / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        if not mine.exists():
            saved = sorted(p.name for p in item.iterdir())
            raise DataLayoutChanged(f"checkpoint step {step} in {self.directory} holds the data-iterator state of "
                                    f"{saved}, not of process {jax.process_index()} of {jax.process_count()}: "
                                    f"resume on the process count the run was checkpointed with")
        return True

    def restore_latest(self, abstract_arrays: Any, data=None) -> tuple[Any, dict] | None:
        """(arrays, meta) of the newest step that restores, None when there is no step; skipped steps are printed
        and then moved aside (module docstring). `CheckpointRestoreError` when steps exist and none restores."""
        skipped: list[tuple[int, str]] = []
        steps = self.all_steps()
        for index in range(len(steps) - 1, -1, -1):
            step = steps[index]
            reason = unreadable_reason(self.directory / str(step))
            if reason is None:
                if data is not None:
                    self._data_item(step)  # another process count is a config problem, not damage: raise
                try:
                    arrays, meta = self.restore(step, abstract_arrays, data)
                except Exception as error:  # noqa: BLE001 - any failure to read this step is a reason to skip it
                    if jax.process_count() > 1:
                        raise self._restore_failed_on_some_process(step, steps[:index], error) from None
                    reason = describe(error)
                else:
                    self._set_aside(skipped)
                    return arrays, meta
            following = f"trying step {steps[index - 1]}" if index else "no older step"
            print(f"checkpoint step {step} in {self.directory} cannot be restored, skipped ({reason}); {following}",
                  flush=True)
            skipped.append((step, reason))
        if skipped:
            listing = "; ".join(f"step {step}: {reason}" for step, reason in skipped)
            raise CheckpointRestoreError(
                f"no checkpoint step in {self.directory} can be restored ({listing}); nothing was moved or deleted. "
                f"If the steps are damaged, move them aside (or delete the directory) to start the stage afresh; "
                f"if every step fails the same way, the run's config no longer matches its checkpoints")
        return None

    def close(self) -> None:
        """Wait for the saves in flight (their steps become restorable) and release the manager; idempotent.
        `CheckpointSaveError` if the save in flight failed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_in_flight()
        finally:
            try:
                self.manager.close()
            except Exception:
                if self._failure is None:
                    raise  # a failure not reported yet; the one already raised is not raised twice

    def close_after_error(self) -> None:
        """`close` while another exception is on its way out (a non-finite step, a preemption, a failure): the last
        good step being saved still gets committed, and a failure to do so is printed, not raised over that one."""
        try:
            self.close()
        except Exception as error:  # noqa: BLE001
            print(f"checkpointer {self.directory}: closing after an error failed with {type(error).__name__}: "
                  f"{error}", flush=True)

    # ------------------------------------------------------------------------------------------------ faults
    def _finish_in_flight(self) -> None:
        """Wait for the save in flight; its background error becomes `CheckpointSaveError` naming its step."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise self._save_failed(self._in_flight, error) from None
        self._in_flight = None

    def _save_failed(self, step: int | None, error: Exception) -> CheckpointSaveError:
        committed = self._committed_steps()
        safe = (f"the last committed step is {committed[-1]} (a resume continues from it)" if committed else
                "no step is committed yet (a resume starts the stage afresh)")
        code, where = os_error(error), named_file(error)
        if code is not None:
            what = errno_text(code) + (f" writing {where}" if where else "")
            fix = FIXES.get(errno.errorcode.get(code, ""), "fix the cause")
        else:
            what, fix = describe(error), "fix the cause"
        self._failure = CheckpointSaveError(
            f"checkpoint step {step} could not be saved in {self.directory}: {what}; step {step} is not committed "
            f"and {safe}. To go on: {fix}, then resume", cause=error)
        return self._failure

    def _committed_steps(self) -> list[int]:
        """The steps whose directories carry their final name (Orbax renames a finished save into place)."""
        try:
            return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())
        except OSError:
            return []

    def _set_aside(self, skipped: list[tuple[int, str]]) -> None:
        """Rename the skipped steps to `STEP.corrupt-<UTC time>` (process 0; the others wait) and forget them."""
        if not skipped:
            return
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            moved = []
            for step, _ in skipped:
                source = self.directory / str(step)
                destination = self.directory / f"{step}.corrupt-{stamp}"
                suffix = 1
                while destination.exists():
                    destination, suffix = self.directory / f"{step}.corrupt-{stamp}-{suffix}", suffix + 1
                try:
                    source.rename(destination)
                except OSError as error:
                    raise CheckpointRestoreError(
                        f"checkpoint step {step} in {self.directory} cannot be restored and could not be moved aside "
                        f"to {destination.name} ({describe(error)}); move or delete it by hand, then resume "
                        f"(otherwise a new save of step {step} would collide with it)") from None
                moved.append(f"{step} -> {destination.name}")
            print(f"checkpoints {self.directory}: moved the unrestorable steps aside, nothing deleted: "
                  f"{', '.join(moved)}", flush=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"mercury_jax checkpoints set aside {self.directory}")
        self.manager.reload()

    def _restore_failed_on_some_process(self, step: int, older: list[int], error: Exception) -> CheckpointRestoreError:
        fix = (f"move it aside (mv {self.directory / str(step)} {self.directory / str(step)}.corrupt) to resume from "
               f"step {older[-1]}" if older else "move it aside to start the stage afresh")
        return CheckpointRestoreError(
            f"checkpoint step {step} in {self.directory} could not be restored on process {jax.process_index()} "
            f"({describe(error)}); with {jax.process_count()} processes the resume does not fall back by itself "
            f"(the processes could not agree on an older step): {fix}")
