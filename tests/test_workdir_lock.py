"""One run per workdir (mercury_jax/runs/workdir_lock.py): a live lock refuses a second run with a message naming
the owner; a stale one (dead pid on this host, not refreshed for too long, or a torn file) is taken over, and a run
that lost its lock to another leaves that one's lock in place when it ends; of runs racing for one workdir exactly
one wins; and the CLI refuses a second `main` on a live workdir in one line."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mercury_jax.runs import workdir_lock
from mercury_jax.runs.workdir_lock import LOCK_NAME, LockOwner, WorkdirLocked, acquire, read_owner

ROOT = Path(__file__).parents[1]


def write_owner(path: Path, **changes) -> LockOwner:
    owner = dataclasses.replace(LockOwner.of_this_process(), **changes)
    path.write_text(json.dumps(dataclasses.asdict(owner)))
    return owner


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(finished.stdout)
    assert not workdir_lock._pid_alive(pid)
    return pid


def test_a_second_run_is_refused_naming_the_owner_and_may_go_once_the_first_ends(tmp_path):
    lock = acquire(tmp_path)
    with pytest.raises(WorkdirLocked) as refused:
        acquire(tmp_path)
    message = str(refused.value)
    assert f"pid {os.getpid()} on host" in message and "in use by another run" in message
    assert str(tmp_path / LOCK_NAME) in message  # what to delete if that run is dead
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    acquire(tmp_path).release()


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    pid = dead_pid()
    write_owner(tmp_path / LOCK_NAME, pid=pid)
    with acquire(tmp_path) as lock:
        assert read_owner(tmp_path / LOCK_NAME).token == lock.owner.token
    assert f"process {pid} on this host is gone" in capsys.readouterr().out


@pytest.mark.parametrize("age_s,taken", [(10.0, False), (workdir_lock.STALE_AFTER_S + 60, True)])
def test_a_lock_of_another_host_is_stale_only_once_it_stopped_being_refreshed(tmp_path, age_s, taken):
    """Its pid, dead on this host, says nothing of a process on another host. Planted bug:
    `if self.host == socket.gethostname() and not _pid_alive(self.pid):` -> `if not _pid_alive(self.pid):`."""
    other_host, pid = f"not-{socket.gethostname()}", dead_pid()
    write_owner(tmp_path / LOCK_NAME, host=other_host, pid=pid, refreshed=time.time() - age_s)
    assert (read_owner(tmp_path / LOCK_NAME).stale_reason(stale_after_s=workdir_lock.STALE_AFTER_S) is None) != taken
    if taken:
        acquire(tmp_path).release()
    else:
        with pytest.raises(WorkdirLocked, match=f"pid {pid} on host {other_host}"):
            acquire(tmp_path)


@pytest.mark.parametrize("age_s,taken", [(0.0, False), (workdir_lock.STALE_AFTER_S + 60, True)])
def test_a_torn_lock_file_ages_by_its_modification_time(tmp_path, age_s, taken):
    path = tmp_path / LOCK_NAME
    path.write_text("")  # a run killed between creating the file and writing it
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    if taken:
        acquire(tmp_path).release()
    else:
        with pytest.raises(WorkdirLocked, match="unreadable lock file"):
            acquire(tmp_path)


def test_a_run_whose_lock_was_taken_over_leaves_the_new_owners_lock(tmp_path, capsys):
    """Planted bug: `if current is not None and current.same_run(self.owner):` -> `if current is not None:` in
    WorkdirLock.release."""
    path = tmp_path / LOCK_NAME
    frozen = acquire(tmp_path, refresh_s=3600.0)  # a run that stopped refreshing (a frozen host, a hung mount)
    stalled = dataclasses.replace(read_owner(path), refreshed=time.time() - workdir_lock.STALE_AFTER_S - 60)
    path.write_text(json.dumps(dataclasses.asdict(stalled)))
    new = acquire(tmp_path)
    assert "taking over the stale lock" in capsys.readouterr().out
    frozen.release()  # the frozen run comes back and ends
    assert read_owner(path) == new.owner
    new.release()
    assert not path.exists()


def test_a_release_during_a_refresh_leaves_no_lock_behind(tmp_path, monkeypatch):
    """The refresh thread is inside its write when the run ends. Planted bug: no
    `self._thread.join(timeout=RELEASE_WAIT_S)` in WorkdirLock.release (the refresh writes the deleted lock back)."""
    writing, proceed, write = threading.Event(), threading.Event(), workdir_lock._write

    def slow_write(path, owner):
        writing.set()
        proceed.wait(30)
        write(path, owner)
    monkeypatch.setattr(workdir_lock, "_write", slow_write)
    lock = acquire(tmp_path, refresh_s=0.01)
    assert writing.wait(30)
    releaser = threading.Thread(target=lock.release)
    releaser.start()
    releaser.join(timeout=0.5)  # a release that does not wait for the refresh has deleted the lock by now
    proceed.set()
    releaser.join(timeout=30)
    lock._thread.join(timeout=30)  # the refresh has written, whichever way
    assert not releaser.is_alive() and not lock._thread.is_alive() and not (tmp_path / LOCK_NAME).exists()


def test_the_owner_refreshes_the_lock_while_it_runs(tmp_path):
    with acquire(tmp_path, refresh_s=0.1) as lock:
        first = read_owner(tmp_path / LOCK_NAME).refreshed
        time.sleep(0.5)
        assert read_owner(tmp_path / LOCK_NAME).refreshed > first
        assert read_owner(tmp_path / LOCK_NAME).token == lock.owner.token


RACER = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(ROOT)!r})
    from mercury_jax.runs.workdir_lock import acquire, WorkdirLocked
    print("ready", flush=True)
    sys.stdin.readline()  # go
    try:
        lock = acquire(sys.argv[1])
    except WorkdirLocked:
        print("refused", flush=True)
        sys.exit(0)
    print("won", flush=True)
    sys.stdin.readline()  # every racer has answered: release
    lock.release()
""")


def test_of_runs_racing_for_one_workdir_exactly_one_wins(tmp_path, children):
    """Four processes, each up and waiting ("ready"), are let go together ("go") and race for the lock; the winner
    holds it until every racer has answered. The outcome does not depend on timing: while the winner holds the lock,
    O_EXCL refuses every other create and a fresh lock (even one not yet written) is not stale. (The old test started
    the racers at a wall-clock time and let the winner go after 1 s; a racer whose imports the load slowed by more
    than that came after the release and won too.)"""
    racers = [children.start([sys.executable, "-c", RACER, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(4)]
    assert [racer.stdout.readline().strip() for racer in racers] == ["ready"] * 4
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.flush()
    outcomes = [racer.stdout.readline().strip() for racer in racers]
    for racer in racers:
        racer.stdin.close()
    assert [racer.wait(timeout=60) for racer in racers] == [0] * 4
    assert sorted(outcomes) == ["refused"] * 3 + ["won"]
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_runs_started_together_on_one_workdir_one_is_refused(tmp_path, children):
    """Two `python -m mercury_jax.main` runs on one workdir, started together: one trains, the other stops before
    any work with one line naming the first (then the first is killed: it has shown what it needed to)."""
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "mercury_jax.main", "--config", "experiments/sft.py:tiny",
               f"--workdir={workdir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs = [children.start(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    deadline = time.time() + 240
    while all(r.poll() is None for r in runs) and time.time() < deadline:
        time.sleep(0.5)
    refused = next(r for r in runs if r.poll() is not None)
    running = next(r for r in runs if r is not refused)
    _, err = refused.communicate()
    assert running.poll() is None, "the winner must still be training"
    children.kill()  # the winner has shown what it needed to
    assert refused.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is in use by another run" in errors[0], err[-2000:]
    assert f"pid {running.pid} on host" in errors[0]
    assert "Traceback" not in err
