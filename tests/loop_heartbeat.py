"""A heartbeat for event-loop stall tests: a task that wakes every `period` seconds and records each gap."""
from __future__ import annotations

import asyncio
import contextlib
import gc


async def heartbeat(gaps: list[float], period: float = 0.01) -> None:
    """Append the time between consecutive wake-ups to `gaps` until cancelled; a gap far above `period` is a stall
    of the event loop (a callback that blocked it)."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        await asyncio.sleep(period)
        gaps.append(loop.time() - last)
        last = loop.time()


@contextlib.contextmanager
def frozen_heap():
    """Keep the heap a long-lived test worker inherits out of the cyclic collector while a stall is measured.

    A full collection of hundreds of thousands of objects left by earlier tests can land inside any callback and
    cost it ~0.5 s; that is the worker's history, not the code under test (a server freezes its start-up heap the
    same way). Objects made inside the block are still collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
