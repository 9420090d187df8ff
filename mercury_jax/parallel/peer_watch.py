"""Peer watch: when one process of a multi-process run dies, every other one stops within a bound, saying which.

Without it a survivor waits in its next collective until JAX's own heartbeat aborts it (SIGABRT after ~100 s, or a
hang in a barrier), with nothing that names the lost host, the last checkpoint or how to go on.

It uses the coordination service that `jax.distributed` already runs (process 0 hosts it) and its key-value store;
no new machinery. Every `interval_s` each process writes `mercury/heartbeat/<i>` (a counter) and reads its peers'
counters and `mercury/exit/<i>` records. A peer is lost when:
- its counter has not moved for `timeout_s` (killed, hung, or its host gone), or
- it wrote an exit record saying it failed (an exception while this process still runs), or
- the coordinator has not answered for `timeout_s` (process 0, which hosts it, is gone).
One loss comes first from JAX itself: when process 0 dies, the coordination client of every other process sees the
service's socket close and aborts the process at once (SIGABRT, its own message naming "the leader task"); XLA has a
callback for that, but jax 0.10 cannot take a Python one (its status argument fails to convert). So
`runs/run_guard.py` prints the resume command at start-up on every process.
Then this process prints one message (the lost process, the last committed checkpoint, the command that resumes)
and exits with `PEER_LOST_EXIT` at once, even from inside a stuck collective (`os._exit`: nothing else runs).

A process that ends writes its exit record first ("finished", "preempted", "failed: ..."), so a peer that finishes
a little earlier is never mistaken for a lost one. A failing process (`record_exit`; `runs/run_guard.py`) leaves
without JAX's shutdown barrier (which would wait for peers that are gone); process 0 leaves last (`wait_for_peers`),
since closing the service it hosts aborts the rest, and while it waits a silent peer is still judged, so a failure
that a dead peer caused (a collective's "connection reset") ends with the message naming that peer. On three or more
processes the other survivors of such a failure exit with the collective's own error. JAX's own heartbeat timeout is
set above `timeout_s` (`jax_heartbeat_timeout_s`), so the watch speaks first.

The judging runs on a thread of its own that only reads timestamps: a key-value call that blocks on a dead
coordinator cannot stop it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import jax
from jax._src import distributed as jax_distributed  # the coordination client: JAX has no public handle on it

PEER_LOST_EXIT = 75           # EX_TEMPFAIL: the run can go on from its last checkpoint
DEFAULT_TIMEOUT_S = 120.0     # how long a silent peer is waited for (a long compile or save keeps beating)
PREFIX = "mercury/"


def jax_heartbeat_timeout_s(timeout_s: float) -> int:
    """JAX's coordination heartbeat timeout for a watch of `timeout_s`: above it, so the watch's message comes first
    (JAX's default is 100 s)."""
    return int(max(100.0, 2.0 * timeout_s + 30.0))


def timeout_from_argv(argv, environ=os.environ) -> float:
    """`--peer_timeout_s=N` (or `--peer_timeout_s N`) from `argv`, else `MERCURY_PEER_TIMEOUT_S`, else the default;
    read before absl parses the flags, since JAX's heartbeat timeout is set when multi-process JAX starts."""
    value = environ.get("MERCURY_PEER_TIMEOUT_S")
    for i, arg in enumerate(argv[1:], start=1):
        name, eq, text = arg.lstrip("-").partition("=")
        if name == "peer_timeout_s":
            value = text if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        raise SystemExit(f"error: --peer_timeout_s={value!r} is not a number of seconds") from None
    if not 1.0 <= timeout <= 3600.0:
        raise SystemExit(f"error: --peer_timeout_s={timeout} is out of range; use 1..3600 seconds "
                         f"(default {DEFAULT_TIMEOUT_S:.0f})")
    return timeout


class PeerWatch:
    """Heartbeats and judging for this process (`start`, `stop(outcome)`); `lost(now)` is the pure verdict."""

    def __init__(self, client, process_index: int, process_count: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 interval_s: float | None = None, describe: Callable[[], str] = lambda: "",
                 cleanup: Callable[[], None] = lambda: None, exit_process: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.index, self.count = client, process_index, process_count
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else min(5.0, timeout_s / 6.0)
        self.describe, self.cleanup, self.exit_process, self.clock = describe, cleanup, exit_process, clock
        self.peers = [p for p in range(process_count) if p != process_index]
        started = clock()
        self.beats = {p: (None, started) for p in self.peers}  # peer -> (last counter seen, when it last moved)
        self.exits: dict[int, str] = {}
        self.ended: str | None = None  # how this process ends, once it said so
        self.answered = started   # when the coordinator last answered
        self.counter = 0
        self._stop = threading.Event()
        self._threads = []

    def start(self) -> PeerWatch:
        for target, name in ((self._beat_forever, "peer-heartbeat"), (self._judge_forever, "peer-judge")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, outcome: str) -> None:
        """Record a coordinated end ("finished", "preempted": every process leaves through JAX's shutdown barrier)
        and stop watching."""
        self.record_exit(outcome)
        self._stop.set()

    def record_exit(self, outcome: str) -> None:
        """Tell the peers how this process ends. After a failure the watch goes on judging silence (a dead peer may
        be why this process failed), but no longer the peers' own exit records (they stop because of this one)."""
        self.ended = outcome
        try:
            self.client.key_value_set(f"{PREFIX}exit/{self.index}", outcome, allow_overwrite=True)
        except Exception:  # noqa: BLE001  (the coordinator may be gone already: nothing to tell)
            pass

    def after_failure(self, error: BaseException) -> None:
        """This process failed (`runs/run_guard.py` calls this and then exits 1). When a peer's failure came first
        (its record was written before it left, so a collective's "connection closed" here is its doing), leave
        naming it; else record ours. Process 0 then waits for the others to leave, naming one gone silent."""
        try:
            self.beat()  # the peers' records as they are now
        except Exception:  # noqa: BLE001
            pass
        reason = self._failed_peer()
        if reason is not None:
            self.leave(reason)
        self.record_exit(f"failed: {type(error).__name__}: {str(error)[:200]}")
        if self.index == 0:
            self.wait_for_peers(self.timeout_s)
            reason = self._silent_peer(self.clock())
            if reason is not None:
                self.leave(reason)

    def wait_for_peers(self, bound_s: float) -> None:
        """Return once every peer has left (its exit record) or gone silent past the timeout, or after `bound_s`.
        Process 0 leaves last this way: its exit closes the coordination service, which aborts whoever is left."""
        deadline = self.clock() + bound_s
        while self.clock() < deadline and not all(
                peer in self.exits or self.clock() - self.beats[peer][1] > self.timeout_s for peer in self.peers):
            time.sleep(self.interval_s / 2)

    def leave(self, reason: str) -> None:
        """Print the message, record the exit, release what `cleanup` holds, and exit with `PEER_LOST_EXIT`."""
        print(self.message(reason), file=sys.stderr, flush=True)
        if self.ended is None:
            self.record_exit(f"stopped: peer lost: {reason}")
        try:
            self.cleanup()  # e.g. release the workdir lock, so the resume command is not refused
            if self.index == 0:
                self.wait_for_peers(self.timeout_s)
        finally:
            self.exit_process(PEER_LOST_EXIT)

    def beat(self) -> None:
        """One heartbeat: write ours, read the peers' counters and exit records."""
        self.counter += 1
        self.client.key_value_set(f"{PREFIX}heartbeat/{self.index}", str(self.counter), allow_overwrite=True)
        now = self.clock()
        for peer in self.peers:
            value = _try_get(self.client, f"{PREFIX}heartbeat/{peer}")
            if value is not None and value != self.beats[peer][0]:
                self.beats[peer] = (value, now)
            outcome = _try_get(self.client, f"{PREFIX}exit/{peer}")
            if outcome is not None:
                self.exits[peer] = outcome
        self.answered = self.clock()

    def lost(self, now: float) -> str | None:
        """Why the run cannot go on from this process's view (None while every peer is alive or ended well)."""
        if self.ended is None:
            reason = self._failed_peer()
            if reason is not None:
                return reason
        if now - self.answered > self.timeout_s and self.index != 0:
            return (f"process 0 (it hosts the coordination service) has not answered for {now - self.answered:.0f} s "
                    f"(bound {self.timeout_s:.0f} s)")
        return self._silent_peer(now)

    def message(self, reason: str) -> str:
        details = self.describe()
        return (f"mercury_jax: peer lost: {reason}. Process {self.index} of {self.count} stops here (exit "
                f"{PEER_LOST_EXIT}) rather than wait in a collective." + (f" {details}" if details else ""))

    def _failed_peer(self) -> str | None:
        for peer in self.peers:
            outcome = self.exits.get(peer)
            if outcome is not None and outcome != "finished":
                return f"process {peer} stopped ({outcome})"
        return None

    def _silent_peer(self, now: float) -> str | None:
        for peer in self.peers:
            if peer in self.exits:
                continue  # it ended and said so: it is not beating any more, by design
            silent = now - self.beats[peer][1]
            if silent > self.timeout_s:
                return f"process {peer} has sent no heartbeat for {silent:.0f} s (bound {self.timeout_s:.0f} s)"
        return None

    def _beat_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception:  # noqa: BLE001  (an unreachable coordinator: `answered` stops moving; the judge decides)
                pass
            self._stop.wait(self.interval_s)

    def _judge_forever(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s)):
            reason = self.lost(self.clock())
            if reason is not None and not self._stop.is_set():
                self.leave(reason)
                return


def _try_get(client, key: str) -> str | None:
    """A key's value, or None when it is not set (the store answers NOT_FOUND with an exception)."""
    try:
        return client.key_value_try_get(key)
    except Exception as error:  # noqa: BLE001
        if "NOT_FOUND" in str(error) or "not found" in str(error).lower():
            return None
        raise


_WATCH: PeerWatch | None = None


def start(timeout_s: float, describe: Callable[[], str],
          cleanup: Callable[[], None] = lambda: None) -> PeerWatch | None:
    """Watch the peers of this multi-process run (None in a single process or without the coordination service)."""
    global _WATCH
    client = jax_distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return None
    _WATCH = PeerWatch(client, jax.process_index(), jax.process_count(), timeout_s=timeout_s, describe=describe,
                       cleanup=cleanup).start()
    return _WATCH
