"""Seeds derived from the run's seed for grain's shuffles (which take a seed in [0, 2**32))."""
from __future__ import annotations

import numpy as np


def derived_seed(*parts: int) -> int:
    """An independent, reproducible seed for the stream named by `parts` (e.g. (run seed, data shard))."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])
