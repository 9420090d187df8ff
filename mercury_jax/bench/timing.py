"""Wall-clock timing of a compiled program on a device: compile once, warm up once, then repetitions to completion."""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax


@dataclasses.dataclass
class Timing:
    """Compile seconds and the seconds of each timed run (empty: none finished before the deadline)."""
    compile_s: float
    run_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.run_s) if self.run_s else float("nan")


def measure(lower: Callable[[], jax.stages.Lowered], run: Callable[[jax.stages.Compiled], object], reps: int,
            deadline: float) -> Timing:
    """Compile `lower()` (timed alone), run `run(compiled)` once untimed (first-run allocations), then up to `reps`
    timed runs, each until `jax.block_until_ready` of what it returns; no new run starts after `deadline`
    (`time.monotonic()`) once one has been timed."""
    start = time.perf_counter()
    compiled = lower().compile()
    timing = Timing(time.perf_counter() - start, [])
    jax.block_until_ready(run(compiled))
    for _ in range(reps):
        if timing.run_s and time.monotonic() > deadline:
            break
        start = time.perf_counter()
        jax.block_until_ready(run(compiled))
        timing.run_s.append(time.perf_counter() - start)
    return timing
