"""The SFT stage's data on the learner mesh: which data shards this process reads, its rows placed on its own
devices, and each step's summary gathered from every process (docs/DATA.md "Hosts and shards").

Data shards are the learner mesh's row blocks: a batch of `batch_rows` rows split over `ROW_AXES` into S blocks
(S = 1 off a mesh) comes from S grain streams (`data/sft_rows.shard_rows`), block k from shard k. A process reads
only the shards of the blocks its own devices hold (a block repeated over tensor chips of two hosts is read by
both, the same rows) and places them with `jax.make_array_from_callback`, so no host builds another host's rows,
and the global batch is the same on any number of processes. Changing the mesh's row split (S) changes the data
order, as a new seed does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mercury_jax.config.defaults import setting
from mercury_jax.config.roles import ROW_AXES
from mercury_jax.data.row_stream import RowStream
from mercury_jax.data.sft_rows import RowSpec, shard_rows
from mercury_jax.parallel.distributed import all_gather_objects

ARRAY_KEYS = {"tokens": np.int32, "loss_mask": np.float32, "segment_ids": np.int32}  # a row's arrays


def row_blocks(mesh, shape: tuple[int, int]) -> tuple[int, set[int]]:
    """(S, this process's blocks) of a [rows, length] batch on `mesh` split over `ROW_AXES`."""
    if mesh is None:
        return 1, {0}
    sharding = NamedSharding(mesh, PartitionSpec(ROW_AXES))
    starts = {index[0].start or 0 for index in sharding.devices_indices_map(shape).values()}
    block = shape[0] // len(starts)
    mine = {(index[0].start or 0) // block for index in sharding.addressable_devices_indices_map(shape).values()}
    return len(starts), mine


class SftData:
    """The stream of this process's shards (`stream`, checkpointed by the loop) and the batch of each step."""

    def __init__(self, cfg, corpus, tokenizer, *, seed: int, pad_id: int, mesh=None):
        self.mesh, self.shape = mesh, (cfg.batch_rows, cfg.row_length)
        shards, mine = row_blocks(mesh, self.shape)
        self.spec = RowSpec(row_length=cfg.row_length, rows_per_shard=cfg.batch_rows // shards, shards=shards,
                            seed=seed, packing_bins=setting(cfg, "packing_bins"),
                            workers=setting(cfg, "data_workers"), skip_bad=setting(cfg, "skip_bad_records"),
                            pad_id=pad_id)
        self.stream = RowStream(lambda k: shard_rows(corpus, tokenizer, self.spec, k), sorted(mine))
        print(f"[sft] data: process {jax.process_index()} reads shards {sorted(mine)} of {shards} "
              f"({self.spec.rows_per_shard} rows each a step, {len(corpus)} records in all)", flush=True)

    def next(self) -> dict[int, dict]:
        """This process's shards' rows of the next step."""
        return self.stream.next()

    def place(self, local: dict[int, dict]) -> dict:
        """The step's batch [batch_rows, row_length] on the mesh (rows of block k from shard k), or on the device."""
        if self.mesh is None:
            return {key: jnp.asarray(local[0][key]) for key in ARRAY_KEYS}
        sharding = NamedSharding(self.mesh, PartitionSpec(ROW_AXES))
        block = self.spec.rows_per_shard
        # dtype given: a process that holds none of the mesh's devices (the consecutive layout's rollout hosts) reads
        # no shard and calls no callback
        return {key: jax.make_array_from_callback(self.shape, sharding,
                                                  lambda index, key=key: local[(index[0].start or 0) // block][key],
                                                  dtype=dtype)
                for key, dtype in ARRAY_KEYS.items()}

    def summary(self, local: dict[int, dict]) -> dict:
        """Every shard's part of the step, gathered from every process: `rows` (the record ids in each row of the
        batch, in row order), `tokens` (non-padding tokens) and `bad_records` (records skipped as bad)."""
        parts: dict[int, tuple] = {}
        for gathered in all_gather_objects({k: (v["records"], int(np.sum(v["segment_ids"] > 0)), v["bad"])
                                            for k, v in local.items()}):
            parts.update(gathered)
        shards = [parts[k] for k in sorted(parts)]
        return {"rows": [row for records, _, _ in shards for row in records],
                "tokens": sum(tokens for _, tokens, _ in shards), "bad_records": sum(bad for _, _, bad in shards)}
