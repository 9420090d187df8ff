"""Trainers (SFT warm start, SAO, GRPO) and what they share: optimisers, checkpoints, metrics (their data comes
from mercury_jax/data)."""
