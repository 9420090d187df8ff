"""A decode step's routed experts: each (token, expert) pick multiplied with that expert's weights, read straight
from the [L, E, ...] stacks (Pallas TPU kernel), never the unpicked experts."""
from mercury_kernels.picked_experts.pallas import pallas_picked_experts

__all__ = ["pallas_picked_experts"]
