"""The child processes a test starts, owned by one object that ends them on every way out of the test.

    with ChildProcesses() as children:            # or the `children` fixture (tests/conftest.py)
        proc = children.start([sys.executable, "worker.py"], stdout=subprocess.PIPE)
        procs = children.own(local_processes.launch(...))   # Popen objects started elsewhere

Leaving the block by any path (return, a failed assertion, pytest-timeout's exception, KeyboardInterrupt) SIGKILLs
the process group of every child still running and reaps it. A child started here leads its own process group (so
its own children die with it) and, on Linux, is SIGKILLed by the kernel when the test process itself dies (an xdist
worker that crashes, or the suite's hard timeout in tests/conftest.py, which exits without running any `finally`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

# The child asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, which survives exec), then
# execs the command; a tiny Python in front of it rather than a `preexec_fn`, which would fork the threaded test
# process instead of spawning (JAX warns of deadlocks there). It exits at once if the parent is already gone.
_DIE_WITH_PARENT = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_this_process(args) -> list[str]:
    """`args` behind the launcher above, on Linux (elsewhere as they are)."""
    if sys.platform != "linux":
        return list(args)
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *map(str, args)]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group when it leads one, else `proc` alone; a process already gone is left."""
    if proc.poll() is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass


class ChildProcesses:
    """The Popen objects of one test; `kill()` (or leaving the `with` block) ends every one still running."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args, **popen_kwargs) -> subprocess.Popen:
        """`subprocess.Popen(args, **popen_kwargs)` (a list of arguments, no shell) in its own process group, dying
        with this process (Linux); call it from the test's own thread (the kernel's parent-death signal follows the
        thread that started the child)."""
        popen_kwargs.setdefault("start_new_session", True)
        return self.own(subprocess.Popen(_dying_with_this_process(args), **popen_kwargs))[0]

    def own(self, procs) -> list[subprocess.Popen]:
        """Take `procs` (one Popen or a list) into this owner; returns them as a list."""
        procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
        self.procs.extend(procs)
        return procs

    def kill(self) -> None:
        """SIGKILL every child still running (its whole group when it leads one), reap it and close its pipes and
        its log (`local_processes.launch` hangs one on each Popen)."""
        for proc in self.procs:
            _kill_group(proc)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout, proc.stderr, getattr(proc, "log", None)):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> ChildProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
