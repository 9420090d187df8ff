"""One run per workdir: `WORKDIR/run.lock` names the run that owns the directory, and a second run is refused.

Without it, a second `main` on a live workdir resumes from the first run's in-flight checkpoints and trains beside
it, and two runs started together both finish with their metrics interleaved (docs/DESIGN.md "Faults").

The lock file is JSON: user, host, pid, the command, when the run started and when the owner last refreshed it, and
a random token. The owner refreshes it every `refresh_s` from a daemon thread and deletes it when the run ends
(normally, on an error or on a preemption), if it still names this run (token, host, pid and start): a run whose
lock was taken over in the meantime leaves the new owner's lock alone. A lock is stale, and taken over with a
printed note, when:
- its host is this host and its pid is no longer alive (a killed run on this machine), or
- it has not been refreshed for `stale_after_s` (a run on another host that died without cleaning up).

Taking the lock is atomic on a local filesystem: the file is created with O_EXCL, and a stale lock is first renamed
aside (one of two racing runs wins that rename; the other sees a fresh lock). On a remote root (`gs://`) there is no
exclusive create through epath: the run writes its lock, waits a moment and reads it back, and the run whose token
is not there is refused (the last writer wins; a race inside that moment is not excluded).

In a multi-process run only process 0 takes the lock (it writes the run's files); `main` hands its outcome to every
process, so all of them stop on a refusal.
"""
from __future__ import annotations

import dataclasses
import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid

from etils import epath

from mercury_jax.runs.rundir import is_local

LOCK_NAME = "run.lock"
REFRESH_S = 30.0
STALE_AFTER_S = 300.0   # a lock not refreshed for this long belongs to a dead run (10 missed refreshes)
REMOTE_SETTLE_S = 2.0   # remote roots: how long to wait before reading a written lock back
RELEASE_WAIT_S = 10.0   # how long `release` waits for a refresh in progress (a hung remote write: no longer)


class WorkdirLocked(RuntimeError):
    """Another live run owns the workdir."""


@dataclasses.dataclass(frozen=True)
class LockOwner:
    user: str
    host: str
    pid: int
    command: str
    started: float
    refreshed: float
    token: str

    @classmethod
    def of_this_process(cls) -> LockOwner:
        now = time.time()
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry (containers)
            user = str(os.getuid())
        return cls(user=user, host=socket.gethostname(), pid=os.getpid(), command=" ".join(sys.argv),
                   started=now, refreshed=now, token=uuid.uuid4().hex)

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return (f"pid {self.pid} on host {self.host} (user {self.user}), started {started}, last refreshed "
                f"{now - self.refreshed:.0f} s ago, command: {self.command}")

    def same_run(self, other: LockOwner) -> bool:
        """Whether `other` names the same run: its token, host, pid and start (a refresh changes only `refreshed`)."""
        return (self.token, self.host, self.pid, self.started) == (other.token, other.host, other.pid, other.started)

    def stale_reason(self, *, stale_after_s: float, now: float | None = None) -> str | None:
        """Why this owner's lock is stale (None: it is live)."""
        now = time.time() if now is None else now
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return f"its process {self.pid} on this host is gone"
        if now - self.refreshed > stale_after_s:
            return f"it was not refreshed for {now - self.refreshed:.0f} s (> {stale_after_s:.0f} s)"
        return None


class WorkdirLock:
    """The held lock of a workdir: `release()` (idempotent) deletes it if it is still ours."""

    def __init__(self, path: epath.Path, owner: LockOwner, *, refresh_s: float):
        self.path, self.owner = path, owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_forever, args=(refresh_s,), name="workdir-lock",
                                        daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop refreshing (waiting out a refresh in progress, which would write the lock back) and delete the lock
        if it still names this run; a lock that another run took over stays, untouched."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=RELEASE_WAIT_S)
        current = read_owner(self.path)
        if current is not None and current.same_run(self.owner):
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> WorkdirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _refresh_forever(self, refresh_s: float) -> None:
        while not self._stop.wait(refresh_s):
            current = read_owner(self.path)
            if current is None or not current.same_run(self.owner):
                print(f"warning: the workdir lock {self.path} is no longer this run's (now: "
                      f"{current.describe() if current else 'deleted'}); another run may be writing here", flush=True)
                return
            self.owner = dataclasses.replace(self.owner, refreshed=time.time())
            _write(self.path, self.owner)


def acquire(root: str | os.PathLike, *, stale_after_s: float = STALE_AFTER_S,
            refresh_s: float = REFRESH_S) -> WorkdirLock:
    """Take `root`'s lock for this process, taking over a stale one; `WorkdirLocked` naming the owner of a live one."""
    root = epath.Path(root)
    path = root / LOCK_NAME
    owner = LockOwner.of_this_process()
    for _ in range(3):  # a stale lock moved aside, then a racing run's fresh one seen, at most
        if is_local(path) and _create_exclusive(path, owner):
            return WorkdirLock(path, owner, refresh_s=refresh_s)
        current = read_owner(path)
        if current is None and not is_local(path):
            return _acquire_remote(path, owner, refresh_s=refresh_s)
        if current is None:
            continue  # deleted between our create and our read: try again
        reason = current.stale_reason(stale_after_s=stale_after_s)
        if reason is None:
            raise WorkdirLocked(_refusal(root, path, current))
        print(f"workdir {os.fspath(root)}: taking over the stale lock of {current.describe()}: {reason}", flush=True)
        _move_aside(path, current)
    raise WorkdirLocked(f"workdir {os.fspath(root)}: could not take {path} (other runs keep taking it); "
                        f"use another --workdir")


def read_owner(path: epath.Path) -> LockOwner | None:
    """The lock's owner; None when there is no lock. A lock file that is not ours to read (torn, foreign) is an owner
    refreshed at its file's modification time, so it goes stale like any other."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        fields = json.loads(text)
        return LockOwner(**{f.name: fields[f.name] for f in dataclasses.fields(LockOwner)})
    except (ValueError, KeyError, TypeError):
        modified = float(path.stat().mtime)
        return LockOwner(user="?", host="?", pid=-1, command=f"(unreadable lock file: {text[:80]!r})",
                         started=modified, refreshed=modified, token="")


def _refusal(root: epath.Path, path: epath.Path, owner: LockOwner) -> str:
    return (f"workdir {os.fspath(root)} is in use by another run: {owner.describe()}. Wait for it to finish, use "
            f"another --workdir, or, if that run is dead, delete {os.fspath(path)} (a lock not refreshed for "
            f"{STALE_AFTER_S:.0f} s is taken over by itself)")


def _create_exclusive(path: epath.Path, owner: LockOwner) -> bool:
    try:
        fd = os.open(os.fspath(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(_encode(owner))
    return True


def _move_aside(path: epath.Path, stale: LockOwner) -> None:
    """Rename the stale lock away (atomic locally: of two runs taking it over, one rename succeeds)."""
    aside = path.parent / f"{LOCK_NAME}.stale-{stale.token or uuid.uuid4().hex}"
    try:
        path.rename(aside)
    except FileNotFoundError:
        return  # another run moved it first
    aside.unlink(missing_ok=True)


def _acquire_remote(path: epath.Path, owner: LockOwner, *, refresh_s: float) -> WorkdirLock:
    _write(path, owner)
    time.sleep(REMOTE_SETTLE_S)
    current = read_owner(path)
    if current is None or not current.same_run(owner):
        raise WorkdirLocked(_refusal(path.parent, path, current or owner))
    return WorkdirLock(path, owner, refresh_s=refresh_s)


def _write(path: epath.Path, owner: LockOwner) -> None:
    """Replace the lock's content through a staging file and a rename (a reader never sees half a file)."""
    staging = path.parent / f"{LOCK_NAME}.{owner.token}.tmp"
    staging.write_text(_encode(owner))
    staging.replace(path)


def _encode(owner: LockOwner) -> str:
    return json.dumps(dataclasses.asdict(owner), indent=1) + "\n"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    """A killed child that its parent has not reaped yet still answers kill(pid, 0); /proc says it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
