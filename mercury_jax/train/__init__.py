"""Trainers (SFT warm start, SAO, GRPO) and what they share: optimisers, checkpoints, metrics, task streams."""
