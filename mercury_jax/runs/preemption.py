"""Preemption: a SIGTERM (a scheduler taking the machine back) makes the training loop checkpoint the step it is
finishing and exit, so the rerun with the same workdir resumes there, not at the last periodic checkpoint.

`install()` (called by `mercury_jax.main`) turns SIGTERM into a request and nothing else: the step in progress
finishes (its batch, update, metrics), `Checkpointer.should_save` is then true whatever the cadence, and the loop's
`exit_if_requested` waits for that save to be committed and raises `Preempted` (a SystemExit with status
128 + signal number, 143 for SIGTERM). A loop run without `install()` is never interrupted this way.

Several processes: the signal may reach one host only, or the hosts at different steps, while the checkpoint save is
collective; a per-process flag would let some processes enter the save and others not (a hang). So in a multi-process
run `install()` leaves SIGTERM to JAX's own preemption notifier (the coordination service's, which `jax.distributed`
starts), and the loop calls `poll(step)` once a step on every process: `multihost_utils.reached_preemption_sync_point`
is true on every process at the same step once any process got the signal, so all save that step and exit 143.
"""
from __future__ import annotations

import signal
import threading

from jax._src import distributed as jax_distributed  # whether JAX's preemption sync manager runs: no public handle
from jax.experimental import multihost_utils

_requested: int | None = None  # the signal number received, if any
_synced = False  # multi-process: JAX's notifier takes the signal and `poll` asks for the common sync point


class Preempted(SystemExit):
    """The run stopped on a preemption signal after checkpointing `step`."""
    def __init__(self, step: int, signum: int):
        super().__init__(128 + signum)
        self.step, self.signum = step, signum


def install(signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Turn `signals` into a preemption request (main thread only, as Python's `signal.signal` requires). In a
    multi-process run with JAX's preemption service, SIGTERM stays with JAX's notifier (see the module docstring)."""
    global _synced
    if jax_distributed.global_state.preemption_sync_manager is not None:
        _synced = True
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("preemption.install() must run on the main thread (Python delivers signals there); call "
                           "it from the entry point before the training loop starts")
    for signum in signals:
        signal.signal(signum, _request)


def requested() -> bool:
    return _requested is not None


def poll(step: int) -> bool:
    """After step `step`, on every process (the same steps everywhere): whether to checkpoint and stop now. One
    process alone just reads its flag; several ask JAX's preemption sync point, true everywhere at the same step."""
    global _requested
    if _synced and _requested is None and multihost_utils.reached_preemption_sync_point(step):
        _requested = signal.SIGTERM  # JAX's notifier listens for SIGTERM only
    return _requested is not None


def reset() -> None:
    """Forget a request (tests; a process that goes on after handling one)."""
    global _requested, _synced
    _requested, _synced = None, False


def exit_if_requested(step: int, name: str, checkpointer=None) -> None:
    """After step `step` (and its save, which `Checkpointer.should_save` forced): when a preemption was requested,
    wait for the checkpoint to be committed, close the checkpointer and raise `Preempted`."""
    if _requested is None:
        return
    where = "no checkpointer: nothing saved"
    if checkpointer is not None:
        checkpointer.close()
        where = f"checkpoint of step {step} saved in {checkpointer.directory}"
    print(f"[{name}] {signal.Signals(_requested).name} received: {where}; rerun with the same --workdir to resume",
          flush=True)
    raise Preempted(step, _requested)


def _request(signum, frame) -> None:
    global _requested
    _requested = signum
