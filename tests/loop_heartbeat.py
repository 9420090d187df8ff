"""A heartbeat for event-loop stall tests: a task that wakes every `period` seconds and records each gap."""
from __future__ import annotations

import asyncio


async def heartbeat(gaps: list[float], period: float = 0.01) -> None:
    """Append the time between consecutive wake-ups to `gaps` until cancelled; a gap far above `period` is a stall
    of the event loop (a callback that blocked it)."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        await asyncio.sleep(period)
        gaps.append(loop.time() - last)
        last = loop.time()
