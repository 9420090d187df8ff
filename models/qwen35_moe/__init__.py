"""Flax NNX Qwen3.5-MoE (gated attention + Gated DeltaNet, dropless MoE) with HF import/export."""
from models.qwen35_moe.cache import cache_bytes, init_cache
from models.qwen35_moe.config import PRESETS, Qwen35MoeConfig
from models.qwen35_moe.model import Qwen35MoeForCausalLM, Qwen35MoeModel

__all__ = ["PRESETS", "Qwen35MoeConfig", "Qwen35MoeForCausalLM", "Qwen35MoeModel", "cache_bytes", "init_cache"]
