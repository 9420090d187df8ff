"""SFT warm start: next-token loss on the action tokens of oracle trajectories, packed with segment ids.

    python -m mercury_jax.main --config experiments/sft.py:tiny --workdir /tmp/sft_tiny
    python -m mercury_jax.main --config experiments/sft.py --workdir gs://bucket/sft   # 35B-A3B from HF
"""
from __future__ import annotations

import ml_collections

from experiments import common


def sft_config(tiny: bool) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.steps = 200 if tiny else 2000
    c.batch_rows = 8 if tiny else 64
    c.row_length = 800 if tiny else 32768
    c.optimizer = ml_collections.ConfigDict(dict(lr=1e-3 if tiny else 1e-5, warmup_steps=20 if tiny else 50,
                                                 b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.0, grad_clip=1.0))
    c.log_every = 10
    return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c, tiny = common.base_config("sft", arg)
    c.sft = sft_config(tiny)
    c.checkpoint = common.checkpoint_config(every=50 if tiny else 500)
    return c
