"""The tiny SAO demo (`experiments/sao.py:tiny`) laid out for several hosts, as a config file for
`mercury_jax/bench/async_sao.py`:

    python -m mercury_jax.main --config mercury_jax/bench/async_sao_config.py:async --workdir DIR

8 devices in groups of rollout 4 (two replicas of 2 devices, fsdp), actor 2 and critic 2; in the `consecutive`
layout on 2 processes of 4 devices the rollout is on process 0 and the learners on process 1, the released run's
split. `:async` samples asynchronously (the released mode), `:sync` with the latest weights each batch. Everything
else is the tiny demo's.
"""
from __future__ import annotations

import ml_collections

from experiments import sao


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg not in ("async", "sync"):
        raise ValueError(f"mercury_jax/bench/async_sao_config.py:{arg}: name 'async' or 'sync'")
    c = sao.get_config("tiny")
    c.rollout.mode = arg
    c.device_layout = "consecutive"
    c.devices = ml_collections.ConfigDict(dict(rollout=4, actor=2, critic=2))
    c.rollout.replica = ml_collections.ConfigDict(dict(fsdp=2))
    return c
