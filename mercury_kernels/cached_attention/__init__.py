"""A decode step's attention over one layer of the carried [L, B, S, K, D] K/V stack, read in place by a Pallas TPU
kernel (the partial softmax a split-K/V decode combines across chips)."""
from mercury_kernels.cached_attention.pallas import MAX_ROWS, block_positions, pallas_cached_partial_softmax

__all__ = ["MAX_ROWS", "block_positions", "pallas_cached_partial_softmax"]
