"""Gated delta rule (the Gated DeltaNet token mixer's recurrence): recurrent and chunked JAX forms, Pallas kernels."""
from mercury_kernels.gated_delta.chunked import chunked_gated_delta_rule
from mercury_kernels.gated_delta.interface import gated_delta_rule
from mercury_kernels.gated_delta.pallas import pallas_gated_delta_rule
from mercury_kernels.gated_delta.reference import gated_delta_step, recurrent_gated_delta_rule

__all__ = ["gated_delta_rule", "gated_delta_step", "recurrent_gated_delta_rule", "chunked_gated_delta_rule",
           "pallas_gated_delta_rule"]
