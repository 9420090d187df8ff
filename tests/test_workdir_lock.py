"""One run per workdir (mercury_jax/runs/workdir_lock.py): a live lock refuses a second run with a message naming
the owner; a stale one (dead pid on this host, not refreshed for too long, or a torn file) is taken over; of runs
racing for one workdir exactly one wins; and the CLI refuses a second `main` on a live workdir in one line."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
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
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_owner(tmp_path / LOCK_NAME, pid=int(finished.stdout))
    with acquire(tmp_path) as lock:
        assert read_owner(tmp_path / LOCK_NAME).token == lock.owner.token
    assert f"process {int(finished.stdout)} on this host is gone" in capsys.readouterr().out


@pytest.mark.parametrize("age_s,taken", [(10.0, False), (workdir_lock.STALE_AFTER_S + 60, True)])
def test_a_lock_of_another_host_is_stale_only_once_it_stopped_being_refreshed(tmp_path, age_s, taken):
    write_owner(tmp_path / LOCK_NAME, host="another-host", pid=1, refreshed=time.time() - age_s)
    if taken:
        acquire(tmp_path).release()
    else:
        with pytest.raises(WorkdirLocked, match="on host another-host"):
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


def test_the_owner_refreshes_the_lock_while_it_runs(tmp_path):
    with acquire(tmp_path, refresh_s=0.1) as lock:
        first = read_owner(tmp_path / LOCK_NAME).refreshed
        time.sleep(0.5)
        assert read_owner(tmp_path / LOCK_NAME).refreshed > first
        assert read_owner(tmp_path / LOCK_NAME).token == lock.owner.token


def test_of_runs_racing_for_one_workdir_exactly_one_wins(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from mercury_jax.runs.workdir_lock import acquire, WorkdirLocked
        time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
        try:
            lock = acquire(sys.argv[2])
        except WorkdirLocked:
            print("refused"); sys.exit(0)
        print("won"); time.sleep(1.0); lock.release()
    """)
    start = time.time() + 2.0  # every racer is up and waiting by then
    racers = [subprocess.Popen([sys.executable, "-c", script, str(start), str(tmp_path)], stdout=subprocess.PIPE,
                               text=True) for _ in range(4)]
    outcomes = sorted(r.communicate(timeout=60)[0].strip() for r in racers)
    assert outcomes == ["refused"] * 3 + ["won"]


@pytest.mark.slow
def test_two_runs_started_together_on_one_workdir_one_is_refused(tmp_path):
    """Two `python -m mercury_jax.main` runs on one workdir, started together: one trains, the other stops before
    any work with one line naming the first (then the first is killed: it has shown what it needed to)."""
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "mercury_jax.main", "--config", "experiments/sft.py:tiny",
               f"--workdir={workdir}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    try:
        deadline = time.time() + 240
        while all(r.poll() is None for r in runs) and time.time() < deadline:
            time.sleep(0.5)
        refused = next(r for r in runs if r.poll() is not None)
        running = next(r for r in runs if r is not refused)
        _, err = refused.communicate()
        assert running.poll() is None, "the winner must still be training"
    finally:
        for r in runs:
            r.kill()
    assert refused.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is in use by another run" in errors[0], err[-2000:]
    assert f"pid {running.pid} on host" in errors[0]
    assert "Traceback" not in err
