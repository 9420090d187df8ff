"""Rollout: our JAX sampler with static-shape slots and continuous batching (DESIGN.md, "Rollout").

    generate(model, prompts, *, max_new_tokens, ...)   -> list[Sample]   one-shot API
    Engine(model, num_slots=, max_length=)             continuous batching; Request(continue_from=) for multi-turn
    Sampler                                            the jitted prefill / decode over slots
    sampling.sample_tokens                             temperature / top-k / top-p, recorded log-probs
"""
from mercury_jax.rollout.engine import Engine, Request, Sample
from mercury_jax.rollout.generate import generate
from mercury_jax.rollout.sampler import Sampler

__all__ = ["Engine", "Request", "Sample", "Sampler", "generate"]
