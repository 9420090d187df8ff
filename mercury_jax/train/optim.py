"""Optimisers with fp32 master weights: Adam(W) with linear warm-up, optional global-norm clipping.

Parameters are kept in fp32 (the model casts to the bf16 compute dtype at use), so a 1e-6 step is not rounded
away; optimiser moments are fp32 too.
"""
from __future__ import annotations

import ml_collections
import optax

from mercury_jax.config.defaults import setting


def make_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """From fields lr, warmup_steps, b1, b2, eps, weight_decay, grad_clip (0 = off)."""
    schedule = optax.constant_schedule(cfg.lr)
    if setting(cfg, "warmup_steps"):
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps])
    parts = []
    if setting(cfg, "grad_clip"):
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=setting(cfg, "eps"),
                             weight_decay=setting(cfg, "weight_decay")))
    return optax.chain(*parts)
