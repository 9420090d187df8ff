"""SFT warm start: next-token loss on the action tokens of oracle trajectories, packed with segment ids.

    python -m mercury_jax.main --config experiments/sft.py --workdir gs://bucket/sft   # 35B-A3B from HF
    python -m mercury_jax.main --config experiments/sft.py:tiny --workdir /tmp/sft_tiny
    python -m mercury_jax.main --config experiments/sft.py:long --workdir gs://bucket/sft_long   # 131,072 tokens

`:long` is the long-context warm start (the pivot-GRPO seed's, Asis-style): rows of 131,072 tokens, each split
by position over 8 chips of the mesh's `sequence` axis (context parallelism, docs/MODEL.md §8), 16,384 tokens of
a row a chip.
"""
from __future__ import annotations

import ml_collections

from experiments import common


def sft_config() -> ml_collections.ConfigDict:
    """The released warm start's optimisation (also the `sft` section of SAO and GRPO configs)."""
    c = ml_collections.ConfigDict()
    c.steps = 2000
    c.batch_rows = 64
    c.row_length = 32768
    # gradient accumulation inside each step (train/microbatch.py): 64 rows over the 32 chips of the actor's mesh,
    # 2 micro-batches of one 32,768-token row a chip
    c.micro_batches = 2
    # the corpus (docs/DATA.md): JSONL or ArrayRecord chat records with tool calls; files, globs or directories,
    # comma-separated, local or gs:// ("": the oracle chats of the world's train tasks)
    c.data = ""
    c.data_workers = 2            # grain worker processes that render and pack rows (0: in the training process)
    c.packing_bins = 8            # rows open at once while packing (first fit)
    c.skip_bad_records = False    # True: skip records that cannot be trained on, counted as bad_records
    c.optimizer = ml_collections.ConfigDict(dict(lr=1e-5, warmup_steps=50, b1=0.9, b2=0.98, eps=1e-8,
                                                 weight_decay=0.0, grad_clip=1.0))
    c.log_every = 10
    return c


def tiny_sft(c: ml_collections.ConfigDict) -> None:
    """`:tiny` overrides of an `sft` section."""
    c.steps = 200
    c.batch_rows = 8
    c.micro_batches = 1
    c.data_workers = 0
    c.row_length = 800
    c.optimizer.lr = 1e-3
    c.optimizer.warmup_steps = 20


def long_sft(c: ml_collections.ConfigDict) -> None:
    """`:long` overrides of an `sft` section: 131,072-token rows, the released step's tokens (16 x 131,072 =
    64 x 32,768); 2 micro-batches of one row a row shard, 16,384 tokens a chip (BENCHMARKS "pod")."""
    c.row_length = 131072
    c.batch_rows = 16
    c.micro_batches = 2


# 64 chips: 8 row shards, each row's positions over 8 chips; parameters and Adam states over all 64 (`embed` ->
# fsdp x sequence). fsdp 16 x sequence 4 (32,768 tokens a chip) needs 89.9 GiB a chip (BENCHMARKS "pod")
LONG_MESH = dict(fsdp=8, sequence=8)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    tiny = common.is_tiny("sft", arg, common.VARIANTS + ("long",))
    c = common.base_config("sft")
    c.sft = sft_config()
    c.checkpoint = common.checkpoint_config(every=500)
    c.devices = ml_collections.ConfigDict(dict(actor=32))  # all 0: the default device
    c.mesh = common.mesh_config(("actor",))

    if arg == "long":
        long_sft(c.sft)
        c.devices.actor = 64
        c.mesh = common.mesh_config(("actor",), **LONG_MESH)
    if tiny:
        common.tiny_common(c)
        tiny_sft(c.sft)
        c.checkpoint.every = 50
        c.devices.actor = 0
    return c
