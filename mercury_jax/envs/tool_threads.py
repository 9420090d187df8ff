"""Blocking environment work (synchronous tools, world building, grading) off the event loop, in a bounded set of
daemon threads whose callers can stop waiting.

    result = await run_blocking(index.search, query, 5)             # the loop keeps serving other episodes
    result = await run_blocking(ep.grade, text, transcript, timeout_s=60)   # TimeoutError after 60 s

Why not `asyncio.to_thread`: the loop's default executor is joined by `asyncio.run` on exit and its threads are
joined at interpreter exit, so one tool that never returns would hang the rollout worker's shutdown (or the
process). Here a caller that times out (or is cancelled) abandons its thread instead.

A runaway thread (Python cannot kill a thread) keeps running until its function returns; its result is discarded,
and it keeps its slot until then. At most `max_threads` run at once, so runaways cannot pile up without bound: when
every slot is held, new work waits for a slot (within its own timeout) instead of starting another thread. The
episode that abandoned the thread is marked (its observation's `failure`, then `Trajectory.env_failure`) and is
not trained on: a runaway tool may still change that episode's state after the call was given up.
`ToolThreads.stats()` counts the running and the abandoned threads.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

DEFAULT_MAX_THREADS = 64
_SLOT_POLL_S = 0.005  # how often a caller retries for a slot while all are held (rare: only runaways hold them)


class ToolThreads:
    """At most `max_threads` daemon threads running blocking calls for coroutines on any event loop.

    Workers are kept (idle ones wait `idle_exit_s` for work, then end): starting a thread makes the starter wait
    until the thread runs, milliseconds on a busy machine, which must not be paid on the event loop per call.
    """

    def __init__(self, max_threads: int = DEFAULT_MAX_THREADS, *, idle_exit_s: float = 60.0):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads, self.idle_exit_s = max_threads, idle_exit_s
        self._slots = threading.BoundedSemaphore(max_threads)  # one per call from start to return
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = self._abandoned = self._workers = self._idle = 0

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a thread of this pool; raises what `fn` raises, or `TimeoutError` after
        `timeout_s` seconds (waiting for a free slot included), in which case the thread is abandoned."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self._slots.acquire(blocking=False):
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"all {self.max_threads} tool threads stayed busy for {timeout_s:g} s "
                                   f"({self._abandoned} abandoned by their callers)")
            await asyncio.sleep(_SLOT_POLL_S)
        future = loop.create_future()
        call = {"done": False, "abandoned": False}
        with self._lock:
            self._running += 1
            start_worker = self._idle == 0  # slots bound calls, so workers never exceed max_threads
            if start_worker:
                self._workers += 1
            else:
                self._idle -= 1  # that idle worker takes this job
        self._jobs.put((loop, future, call, fn, args, kwargs))
        if start_worker:
            threading.Thread(target=self._worker, daemon=True, name="tool-thread").start()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives as the
            # result does (the episode would run on after its run was cancelled)
            async with asyncio.timeout_at(deadline):
                return await future
        except BaseException:  # timed out or cancelled: a thread still running is abandoned
            with self._lock:
                if not call["done"]:
                    call["abandoned"] = True
                    self._abandoned += 1
            raise

    def stats(self) -> dict[str, int]:
        """`running`: calls executing now; `abandoned`: those still running after their caller gave up;
        `workers`: threads alive (running or idle)."""
        with self._lock:
            return {"running": self._running, "abandoned": self._abandoned, "workers": self._workers,
                    "max_threads": self.max_threads}

    def _worker(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # else a caller has just counted on this worker: take its job
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue
            self._work(*job)
            with self._lock:
                self._idle += 1

    def _work(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, call: dict, fn, args, kwargs) -> None:
        try:
            try:
                outcome, failed = fn(*args, **kwargs), False
            except BaseException as error:  # noqa: BLE001 (handed to the awaiting coroutine)
                outcome, failed = error, True
            try:
                loop.call_soon_threadsafe(_settle, future, outcome, failed)
            except RuntimeError:  # the loop has closed: nobody waits for this result any more
                pass
        finally:
            with self._lock:
                call["done"] = True
                self._running -= 1
                self._abandoned -= call["abandoned"]
            self._slots.release()


def _settle(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    if future.done():  # abandoned (cancelled) by its caller
        return
    if failed:
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


TOOL_THREADS = ToolThreads()
"""The process-wide pool the MCP adapter and the episodes use (one bound for all event loops and workers)."""


async def run_blocking(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """`TOOL_THREADS.run(fn, *args, timeout_s=timeout_s, **kwargs)`."""
    return await TOOL_THREADS.run(fn, *args, timeout_s=timeout_s, **kwargs)
