"""What `main` holds around a run: the workdir's lock and, on several processes, the peer watch.

    with run_guard(run, sys.argv, peer_timeout_s=...):
        ... resume checks, config, the pipeline ...

- The workdir lock (`workdir_lock.py`) is taken by process 0, and every process learns whether it was refused, so all
  of them stop with the same one-line message naming the owner.
- The peer watch (`parallel/peer_watch.py`) makes every process exit within `peer_timeout_s` when another one dies,
  with a message naming it, the last committed checkpoint of each stage and the command that resumes.
- On the way out the process records how it ended for its peers ("finished", "preempted" or "failed: ..."), and
  process 0 releases the lock, also when the watch stops it (a killed run leaves the lock behind; the next run takes
  it over as stale). A multi-process run that fails here waits for its peers to leave, then exits without JAX's
  shutdown barrier (`_leave_after_failure`), printing the error as `report` says (main's: the project's own errors
  as one `error:` line, exit 2, as a single process ends; `mercury_jax/cli_errors.py`).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import sys
import traceback
from collections.abc import Callable

import jax

from mercury_jax.parallel import distributed, peer_watch
from mercury_jax.runs import workdir_lock
from mercury_jax.runs.preemption import Preempted
from mercury_jax.runs.rundir import RunDir


def print_failure(error: BaseException) -> int:
    """What a process that failed prints before it leaves (a SystemExit's text, else the traceback); its status."""
    if isinstance(error, SystemExit):
        print(error.code, file=sys.stderr)
    else:
        traceback.print_exception(error)
    return 1


@contextlib.contextmanager
def run_guard(run: RunDir, argv: list[str], *, peer_timeout_s: float,
              report: Callable[[BaseException], int] = print_failure):
    """The lock and the peer watch around a run (module docstring). `report(error)` prints a failure of a
    multi-process run and returns its exit status (a single process raises it to the entry point instead)."""
    lock = hold_workdir(run)
    watch = peer_watch.start(peer_timeout_s, describe=lambda: f"{run.describe_checkpoints()}. "
                                                              f"Resume on every host with: {resume_command(run, argv)}",
                             cleanup=lock.release if lock is not None else lambda: None)
    if watch is not None:  # the one loss the watch cannot report: JAX aborts the survivors at once, in its own words
        print(f"peer watch: a process silent for {peer_timeout_s:.0f} s stops the run with a message; if process 0 "
              f"(it hosts JAX's coordination service) dies, JAX aborts the other processes at once instead. Either "
              f"way, resume on every host with: {resume_command(run, argv)}", file=sys.stderr, flush=True)
    try:
        yield
    except Preempted:
        if watch is not None:
            watch.stop("preempted")
        raise
    except BaseException as error:
        if watch is None:
            raise
        if lock is not None:
            lock.release()
        _leave_after_failure(watch, error, report)
    else:
        if watch is not None:
            watch.stop("finished")
    finally:
        if lock is not None:
            lock.release()


def _leave_after_failure(watch: peer_watch.PeerWatch, error: BaseException, report=print_failure,
                         exit_process: Callable[[int], None] = os._exit) -> None:
    """A multi-process run that failed here: leave naming a peer whose failure or silence caused this one, else
    tell the peers (their watches stop them, naming this process and the error), print the error (`report`) and
    exit at once, skipping JAX's shutdown barrier at interpreter exit (it would wait for peers that left without
    it). A SystemExit with a number keeps it (1 without one)."""
    if isinstance(error, SystemExit) and not isinstance(error.code, str):
        code = error.code if isinstance(error.code, int) else 1
    else:
        code = report(error)
    sys.stdout.flush(), sys.stderr.flush()
    watch.after_failure(error)
    exit_process(code)


def hold_workdir(run: RunDir) -> workdir_lock.WorkdirLock | None:
    """The workdir's lock, taken by process 0 (None elsewhere); SystemExit with the refusal on every process."""
    lock, refusal = None, None
    if distributed.is_primary():
        try:
            lock = workdir_lock.acquire(run.root)
        except workdir_lock.WorkdirLocked as error:
            refusal = str(error)
    if jax.process_count() > 1:
        refusal = distributed.all_gather_objects(refusal)[0]
    if refusal is not None:
        raise SystemExit(f"error: {refusal}")
    return lock


def resume_command(run: RunDir, argv: list[str]) -> str:
    """This run's command line with `--workdir` pinned to the run directory (a default workdir is timestamped)."""
    args = [a for i, a in enumerate(argv[1:], start=1)
            if not a.startswith("--workdir") and not (i > 1 and argv[i - 1] == "--workdir")]
    return shlex.join(["python", "-m", "mercury_jax.main", *args, f"--workdir={run.root}"])
