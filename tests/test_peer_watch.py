"""The peer watch (mercury_jax/parallel/peer_watch.py): its verdicts on a fake key-value store and clock, and two
real processes where one is SIGKILLed mid-run: the survivor exits with PEER_LOST_EXIT within the bound, naming the
lost process, the last committed checkpoint and the resume command, instead of waiting in its collective."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mercury_jax.parallel import peer_watch
from mercury_jax.parallel.peer_watch import PEER_LOST_EXIT, PeerWatch

pytestmark = pytest.mark.timeout(1800)  # several processes of tiny runs on a loaded 2-core host (pyproject: 900)

WORKER = Path(__file__).with_name("peer_watch_worker.py")


class FakeStore:
    """The coordination client's key-value calls on a dict; `down` makes every call fail like a dead coordinator."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        self.values[key] = value

    def key_value_try_get(self, key):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def watches(count=3, timeout_s=10.0):
    store, clock = FakeStore(), Clock()
    return store, clock, [PeerWatch(store, i, count, timeout_s=timeout_s, clock=clock) for i in range(count)]


def test_every_peer_beating_is_alive_and_a_silent_one_is_named_after_the_bound():
    store, clock, (w0, w1, w2) = watches()
    for _ in range(5):
        clock.now += 3.0
        for w in (w0, w1, w2):
            w.beat()
        assert w0.lost(clock.now) is None and w1.lost(clock.now) is None
    for _ in range(4):  # process 2 goes silent; its last counter is seen one beat later: then 9 s < the 10 s bound
        clock.now += 3.0
        w0.beat(), w1.beat()
    assert w0.lost(clock.now) is None
    clock.now += 3.0
    w0.beat()
    assert "process 2 has sent no heartbeat for 12 s" in w0.lost(clock.now)


def test_a_peer_that_finished_is_not_lost_but_one_that_failed_is_at_once():
    """Planted bug: `continue  # it ended and said so` -> `pass` in PeerWatch._silent_peer (a finished peer judged by
    its silence)."""
    store, clock, (w0, w1, w2) = watches()
    for w in (w0, w1, w2):
        w.beat()
    w2.stop("finished")
    w0.beat(), w1.beat()  # process 2's last counter, seen now
    clock.now += 60.0
    w0.beat(), w1.beat()
    for w in (w0, w1):
        assert clock.now - w.beats[2][1] == 60.0 > w.timeout_s  # it really looks silent
        assert w.exits[2] == "finished" and w.lost(clock.now) is None
    w1.stop("failed: ValueError: bad batch")
    w0.beat()
    assert w0.lost(clock.now) == "process 1 stopped (failed: ValueError: bad batch)"


def test_the_survivor_of_a_finished_peer_goes_on_past_the_timeout():
    """Process 0's judge thread runs for five timeouts after process 1 finished, silent since, and does not stop (its
    only peer is the finished one, so no other silence can stop it under load). Planted bug:
    `continue  # it ended and said so` -> `pass` in PeerWatch._silent_peer."""
    store, exits, timeout_s = FakeStore(), [], 0.3
    finished = PeerWatch(store, 1, 2, timeout_s=timeout_s)
    finished.beat()
    finished.stop("finished")
    survivor = PeerWatch(store, 0, 2, timeout_s=timeout_s, interval_s=0.05, exit_process=exits.append).start()
    time.sleep(5 * timeout_s)
    silent_s, ended = time.monotonic() - survivor.beats[1][1], survivor.ended
    survivor.stop("finished")
    assert silent_s > timeout_s and survivor.exits == {1: "finished"}  # process 1 looked silent, and had finished
    assert exits == [] and ended is None


def test_a_dead_coordinator_is_named_by_the_other_processes():
    store, clock, (w0, w1) = watches(count=2)
    w0.beat(), w1.beat()
    store.down = True
    clock.now += 11.0
    with pytest.raises(RuntimeError):
        w1.beat()
    assert w1.lost(clock.now).startswith("process 0 (it hosts the coordination service) has not answered for 11 s")


def test_the_judge_thread_prints_the_message_and_exits():
    store, exits = FakeStore(), []
    watch = PeerWatch(store, 0, 2, timeout_s=0.3, interval_s=0.05, describe=lambda: "last committed: sao step 3.",
                      exit_process=exits.append)
    watch.start()
    deadline = time.time() + 10
    while not exits and time.time() < deadline:
        time.sleep(0.05)
    watch.stop("finished")
    assert exits == [PEER_LOST_EXIT]
    assert "peer lost: process 1 has sent no heartbeat" in watch.message("process 1 has sent no heartbeat")


@pytest.mark.parametrize("argv,env,expected", [
    (["main.py"], {}, peer_watch.DEFAULT_TIMEOUT_S),
    (["main.py", "--peer_timeout_s=7"], {}, 7.0),
    (["main.py", "--peer_timeout_s", "9"], {"MERCURY_PEER_TIMEOUT_S": "5"}, 9.0),
    (["main.py"], {"MERCURY_PEER_TIMEOUT_S": "5"}, 5.0),
])
def test_the_timeout_comes_from_the_flag_or_the_environment(argv, env, expected):
    assert peer_watch.timeout_from_argv(argv, env) == expected
    assert peer_watch.jax_heartbeat_timeout_s(expected) > expected  # JAX's own abort comes after ours


def test_a_bad_timeout_is_one_line():
    with pytest.raises(SystemExit, match="out of range"):
        peer_watch.timeout_from_argv(["main.py", "--peer_timeout_s=0"], {})


def run_two(children, tmp_path, victim: int, timeout_s: float = 4.0, how: str = "kill"):
    """Two worker processes (owned by `children`: tests/child_processes.py) on a workdir with a committed step 3 (and
    a step 6 in flight); `victim` SIGKILLs itself 3 s into its run (or raises, `how` = "raise"). Returns the workdir,
    the victim's and the survivor's return codes, the survivor's stderr, and the seconds it took after the first
    process left."""
    from local_processes import free_port

    workdir = tmp_path / "run"
    (workdir / "sao" / "checkpoints" / "3" / "arrays").mkdir(parents=True)  # committed: it holds an array item
    (workdir / "sao" / "checkpoints" / "6.orbax-checkpoint-tmp-1" / "arrays").mkdir(parents=True)
    port, procs = free_port(), []
    for i in range(2):
        env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"}
        procs.append(children.start([sys.executable, str(WORKER), str(workdir), str(victim), "3", str(timeout_s),
                                     how], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=Path(__file__).parents[1]))
    survivor = procs[1 - victim]
    first = procs[1] if how == "raise" else procs[victim]  # a failing process 0 leaves after the other
    first.wait(timeout=120)
    killed_at = time.time()
    _, err = survivor.communicate(timeout=120)
    took = time.time() - killed_at
    procs[victim].wait(timeout=60)
    return workdir, procs[victim].returncode, survivor.returncode, err, took


@pytest.mark.slow
def test_a_killed_worker_process_stops_the_other_within_the_bound_with_the_message(tmp_path, children):
    workdir, victim_rc, rc, err, took = run_two(children, tmp_path, victim=1)
    assert victim_rc == -9
    assert rc == PEER_LOST_EXIT, err[-3000:]
    assert took < 4.0 + 10.0  # the bound, plus a beat and the judge's poll
    message = [line for line in err.splitlines() if "peer lost" in line]
    assert len(message) == 1, err[-3000:]
    assert "process 1 has sent no heartbeat" in message[0]
    assert f"last committed checkpoints: sao step 3 ({workdir}/sao/checkpoints/3)" in message[0]
    assert f"mercury_jax.main --config experiments/sao.py:tiny --workdir={workdir}" in message[0]
    assert not (workdir / "run.lock").exists()  # released on the way out: the resume command is not refused


@pytest.mark.slow
def test_a_killed_coordinator_process_stops_the_other_at_once(tmp_path, children):
    """Process 0 hosts JAX's coordination service: JAX aborts the survivor at once in its own words (the watch cannot
    speak first); the resume command was printed at start-up."""
    workdir, victim_rc, rc, err, took = run_two(children, tmp_path, victim=0)
    assert victim_rc == -9
    assert rc != 0 and took < 4.0 + 10.0, err[-3000:]
    assert f"resume on every host with: python -m mercury_jax.main --config experiments/sao.py:tiny " \
           f"--workdir={workdir}" in err


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_an_error_on_one_process_stops_both_at_once(tmp_path, victim, children):
    """One process raises while the other waits in a collective: the other leaves through its watch (75, naming the
    failed process and its error) at once, not after the timeout; the failed one exits 1, skipping JAX's shutdown
    barrier (which would wait ~100 s for the process that left). Process 0 leaves last."""
    workdir, victim_rc, rc, err, took = run_two(children, tmp_path, victim=victim, how="raise", timeout_s=30.0)
    assert rc == PEER_LOST_EXIT and took < 10.0, err[-3000:]
    assert f"process {victim} stopped (failed: ValueError: a bad batch on this process only)" in err
    assert victim_rc == 1
