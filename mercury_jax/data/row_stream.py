"""A process's SFT data shards as one checkpointable iterator (grain's checkpoint protocol, so
`grain.checkpoint.CheckpointHandler` writes it into the run's Orbax checkpoint, one file a process).

    stream = RowStream(make_shard, shards=[2, 3])   # the shards whose rows this process's devices hold
    rows = stream.next()                             # {shard: that shard's rows of the next step}
    state = stream.get_state()                       # bytes: every shard's grain iterator state (JSON)
    stream.close()                                   # the workers stopped (the training loop calls it at its end)
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence


class RowStream:
    def __init__(self, make_shard: Callable[[int], object], shards: Sequence[int]):
        self.shards = list(shards)
        self.iterators = {k: iter(make_shard(k)) for k in self.shards}

    def next(self) -> dict[int, dict]:
        return {k: next(iterator) for k, iterator in self.iterators.items()}

    def get_state(self) -> bytes:
        return json.dumps({str(k): iterator.get_state() for k, iterator in self.iterators.items()}).encode()

    def set_state(self, state: bytes) -> None:
        saved = json.loads(state)
        if sorted(saved) != sorted(str(k) for k in self.shards):
            raise ValueError(f"the checkpoint's SFT data state holds shards {sorted(saved)}, this process reads "
                             f"shards {self.shards}: resume on the learner mesh and process count the run was "
                             f"checkpointed with")
        for k, iterator in self.iterators.items():
            iterator.set_state(saved[str(k)])

    def close(self) -> None:
        """Stop the shards' grain workers and free the shared memory of the rows in flight (idempotent). A stream
        left to the garbage collector at an error's exit leaves them to multiprocessing's resource tracker, which
        warns about "leaked shared_memory objects" after the error line."""
        for iterator in self.iterators.values():
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def start_prefetch(self) -> None:
        """Part of the protocol grain's checkpoint handler calls after a restore; the iterators prefetch on their
        own when read."""

    def snapshot(self) -> FrozenState:
        return FrozenState(self.get_state())


class FrozenState:
    """The stream's state at one step, for a checkpoint saved in the background while the stream moves on."""

    def __init__(self, state: bytes):
        self.state = state

    def get_state(self) -> bytes:
        return self.state
