"""The seeded order the RL stages walk their tasks (SAO, group-baseline RL) or pivot states (GRPO) in, by grain.

    order = TaskOrder(items, seed)        # items: a list, or a grain source (a corpus directory's `TaskSource`)
    order.at(p)                           # position p of the endless order: MapDataset.source(items)
                                          #   .shuffle(seed).repeat()[p], a new permutation every epoch
    window = order.take(n)                # the next n positions, read lazily; `consumed` advances by n

Episode ids are positions (episode e samples `order.at(e)`), so the run's state is `consumed`, saved in the
checkpoint's metadata, and any process can reach any position by random access: a multi-process run reads only the
tasks of the episodes its own replicas run (`rollout/sharded_runner.py` indexes the window for its own), with no
host holding the whole list (docs/DATA.md "Hosts and shards").
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain


class TaskOrder:
    def __init__(self, items, seed: int, consumed: int = 0):
        if len(items) == 0:
            raise ValueError("a TaskOrder needs at least one item")
        self.size, self.seed, self.consumed = len(items), seed, consumed
        self.dataset = grain.MapDataset.source(items).shuffle(seed=seed).repeat()

    def at(self, position: int) -> Any:
        """The item at `position` of the endless order (what `take` hands out as the position-th item)."""
        return self.dataset[position]

    def take(self, n: int) -> TaskWindow:
        window = TaskWindow(self, self.consumed, n)
        self.consumed += n
        return window


class TaskWindow(Sequence):
    """Positions [first, first + n) of an order, each read on first access (and kept)."""

    def __init__(self, order: TaskOrder, first: int, n: int, *, repeat: int = 1):
        self.order, self.first, self.n, self.repeat = order, first, n, repeat
        self._read: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.n * self.repeat

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"position {i} of a window of {len(self)}")
        k = (i % len(self)) // self.repeat
        if k not in self._read:
            self._read[k] = self.order.at(self.first + k)
        return self._read[k]

    def repeated(self, times: int) -> TaskWindow:
        """The window with each item `times` times in a row (a group's K episodes of one task), still lazy."""
        window = TaskWindow(self.order, self.first, self.n, repeat=self.repeat * times)
        window._read = self._read
        return window
