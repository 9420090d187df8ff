"""Seeded epoch orders: the one way every stage walks its data, so a resumed run sees the same items in the same
order. Epoch e of n items is the permutation `default_rng([seed, e]).permutation(n)`; a stream's whole state is
how many items it has handed out."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=4)
def epoch_order(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch `epoch`: a permutation seeded by (seed, epoch), so a restart reproduces it."""
    return np.random.default_rng([seed, epoch]).permutation(num_items)


class TaskStream:
    """Items (tasks, pivot states) in a seeded order, reshuffled each epoch; `consumed` counts those handed out."""

    def __init__(self, items: Sequence[Any], seed: int, consumed: int = 0):
        if not items:
            raise ValueError("a TaskStream needs at least one item")
        self.items, self.seed, self.consumed = items, seed, consumed

    def at(self, position: int):
        """The item at `position` of the endless order (what `take` hands out as the position-th item)."""
        epoch, index = divmod(position, len(self.items))
        return self.items[epoch_order(len(self.items), self.seed, epoch)[index]]

    def take(self, n: int) -> list:
        out = [self.at(position) for position in range(self.consumed, self.consumed + n)]
        self.consumed += n
        return out


def batch_rows(num_rows: int, rows_per_batch: int, step: int, seed: int) -> np.ndarray:
    """Row indices of batch `step` (0-based) of a fixed table: epochs of whole batches in `epoch_order`; a table
    smaller than one batch is repeated to fill it."""
    per_epoch = max(num_rows // rows_per_batch, 1)
    epoch, index = divmod(step, per_epoch)
    rows = epoch_order(num_rows, seed, epoch)[index * rows_per_batch:(index + 1) * rows_per_batch]
    return np.resize(rows, rows_per_batch)
