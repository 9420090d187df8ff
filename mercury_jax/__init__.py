"""mercury_jax: JAX/TPU agentic RL post-training for Qwen3.5 hybrid-MoE models."""

__version__ = "0.1.0"
