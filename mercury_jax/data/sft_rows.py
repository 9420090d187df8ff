"""The SFT input pipeline, in grain (docs/DATA.md "Pipeline"): one endless stream of packed rows per data shard.

    source  corpus[shard::shards]            grain.MapDataset.source(corpus).slice: shard k holds records k, k+S, ...
    order   .shuffle(seed of (seed, shard)).repeat()     a new permutation every epoch (grain reseeds per epoch)
    render  .map(Render)                     chat path -> tokens, loss mask (chat_records.py); bad records named
    pack    FirstFitPackIterDataset          rows of `row_length` with segment ids 1, 2, ... (0: padding), first
                                             fit over `packing_bins` open rows
    batch   .batch(rows_per_shard)           this shard's rows of one learner step
    workers .mp_prefetch(num_workers)        render and pack in grain worker processes (0: in this process); a
                                             worker exits when its trainer is gone (`exit_with_parent`)

A shard's rows of step s depend only on (corpus, seed, shard, shards, row_length, packing_bins, workers): not on
the process count or on which process reads it, so a run on 2 processes trains on the same batches as on one.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Any

import grain
import numpy as np
from absl import flags

from mercury_jax.data.chat_records import BadRecord, record_sequence
from mercury_jax.data.seeds import derived_seed


@dataclasses.dataclass(frozen=True)
class RowSpec:
    row_length: int
    rows_per_shard: int   # rows each data shard gives a learner step
    shards: int           # data shards: the learner mesh's row blocks (sft_data.py)
    seed: int
    packing_bins: int = 8
    workers: int = 0
    skip_bad: bool = False
    pad_id: int = 0
    enable_thinking: bool = True


class Render(grain.transforms.Map):
    """(index, raw record, where) -> the packer's element (chat_records.record_sequence); a record given as
    {"tokens", "loss_mask"} is taken as already rendered."""

    def __init__(self, tokenizer, spec: RowSpec):
        self.tokenizer, self.spec = tokenizer, spec

    def map(self, item: tuple[int, Any, str]) -> dict[str, Any]:
        index, raw, where = item
        if isinstance(raw, dict) and "tokens" in raw:
            return pretokenized(raw, index, where, self.spec)
        return record_sequence(self.tokenizer, raw, index, where, row_length=self.spec.row_length,
                               skip_bad=self.spec.skip_bad, enable_thinking=self.spec.enable_thinking)


def pretokenized(raw: dict, index: int, where: str, spec: RowSpec) -> dict[str, Any]:
    tokens, mask = np.asarray(raw["tokens"], np.int32), np.asarray(raw["loss_mask"], np.float32)
    problem = (f"{len(tokens)} tokens but {len(mask)} loss-mask entries" if len(tokens) != len(mask) else
               f"{len(tokens)} tokens, more than sft.row_length {spec.row_length}" if len(tokens) > spec.row_length
               else "no token" if not len(tokens) else None)
    if problem is not None:
        if not spec.skip_bad:
            raise BadRecord(index, where, problem)
        return {"tokens": tokens[:0], "loss_mask": mask[:0], "record": index, "bad": 1}
    return {"tokens": tokens, "loss_mask": mask, "record": index, "bad": 0}


def as_row(packed: dict[str, Any]) -> dict[str, Any]:
    """A packed bin as a learner row: tokens, loss_mask, segment_ids, and the records in it (ids) with the count of
    skipped bad records it carries."""
    return {"tokens": packed["tokens"].astype(np.int32), "loss_mask": packed["loss_mask"].astype(np.float32),
            "segment_ids": packed["tokens_segment_ids"].astype(np.int32),
            "records": [int(r) for r, bad in zip(packed["record"], packed["bad"]) if not bad],
            "bad": int(sum(int(b) for b in packed["bad"]))}


def stack_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tokens": np.stack([r["tokens"] for r in rows]), "loss_mask": np.stack([r["loss_mask"] for r in rows]),
            "segment_ids": np.stack([r["segment_ids"] for r in rows]), "records": [r["records"] for r in rows],
            "bad": sum(r["bad"] for r in rows)}


def shard_rows(corpus, tokenizer, spec: RowSpec, shard: int) -> grain.IterDataset:
    """Shard `shard`'s endless stream of steps: each element is `stack_rows` of `spec.rows_per_shard` rows."""
    if len(corpus) < spec.shards:
        raise ValueError(f"the SFT corpus holds {len(corpus)} records, fewer than its {spec.shards} data shards "
                         f"(one per row block of the learner mesh); give more records or fewer learner row blocks")
    records = grain.MapDataset.source(corpus).slice(slice(shard, None, spec.shards))
    records = records.shuffle(seed=derived_seed(spec.seed, shard)).repeat().map(Render(tokenizer, spec))
    length = {"tokens": spec.row_length, "loss_mask": spec.row_length}
    rows = grain.experimental.FirstFitPackIterDataset(
        records.to_iter_dataset(), length_struct=length, num_packing_bins=spec.packing_bins, shuffle_bins=False,
        meta_features=("record", "bad"), padding_struct={"tokens": spec.pad_id, "loss_mask": 0.0})
    steps = rows.map(as_row).batch(spec.rows_per_shard, batch_fn=stack_rows)
    if spec.workers:
        if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; a library caller (tests, benches) has none
            flags.FLAGS.mark_as_parsed()
        steps = steps.mp_prefetch(grain.MultiprocessingOptions(num_workers=spec.workers),
                                  worker_init_fn=functools.partial(exit_with_parent, trainer_pid=os.getpid()))
    return steps


PARENT_POLL_S = 0.5  # how often a grain worker looks for its trainer


def exit_with_parent(worker_index: int, worker_count: int, *, trainer_pid: int | None = None) -> None:
    """Run in each grain worker before it reads data: a daemon thread ends the worker once the process that
    started it is gone. A trainer killed by SIGKILL (the OOM killer's signal) runs no cleanup, and its workers would
    live on under pid 1, holding memory and shared-memory blocks. A thread that polls the parent pid, not
    PR_SET_PDEATHSIG: that signal fires when the starting *thread* ends, and grain starts workers from a pool.
    `trainer_pid` is bound in the trainer when it builds the pipeline: a worker that gets here only after its trainer
    died (a slow start under load) sees another parent at once, instead of taking pid 1 for its trainer."""
    parent = os.getppid() if trainer_pid is None else trainer_pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        print(f"grain worker {worker_index}/{worker_count}: its trainer (pid {parent}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="mercury-parent-watch", daemon=True).start()
