"""Preemption: a SIGTERM (a scheduler taking the machine back) makes the training loop checkpoint the step it is
finishing and exit, so the rerun with the same workdir resumes there, not at the last periodic checkpoint.

`install()` (called by `mercury_jax.main`) turns SIGTERM into a flag and nothing else: the step in progress
finishes (its batch, update, metrics), `Checkpointer.should_save` is then true whatever the cadence, and the loop's
`exit_if_requested` waits for that save to be committed and raises `Preempted` (a SystemExit with status
128 + signal number, 143 for SIGTERM). A loop run without `install()` is never interrupted this way.
"""
from __future__ import annotations

import signal
import threading

_requested: int | None = None  # the signal number received, if any


class Preempted(SystemExit):
    """The run stopped on a preemption signal after checkpointing `step`."""
    def __init__(self, step: int, signum: int):
        super().__init__(128 + signum)
        self.step, self.signum = step, signum


def install(signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Turn `signals` into a preemption request (main thread only, as Python's `signal.signal` requires)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("preemption.install() must run on the main thread (Python delivers signals there); call "
                           "it from the entry point before the training loop starts")
    for signum in signals:
        signal.signal(signum, _request)


def requested() -> bool:
    return _requested is not None


def reset() -> None:
    """Forget a request (tests; a process that goes on after handling one)."""
    global _requested
    _requested = None


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
