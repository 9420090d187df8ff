"""Flax NNX Qwen3.5-MoE (gated attention + Gated DeltaNet, dropless MoE) with HF import/export."""
from models.qwen35_moe.cache import cache_bytes, init_cache
from models.qwen35_moe.config import PRESETS, Qwen35MoeConfig
from models.qwen35_moe.critic import Qwen35MoeCritic, critic_trainable, split_critic_params
from models.qwen35_moe.hf import CheckpointError, load_hf, save_hf
from models.qwen35_moe.logprobs import sequence_logprobs, token_logprobs
from models.qwen35_moe.model import Qwen35MoeForCausalLM, Qwen35MoeModel

__all__ = ["PRESETS", "CheckpointError", "Qwen35MoeConfig", "Qwen35MoeCritic", "Qwen35MoeForCausalLM",
           "Qwen35MoeModel", "cache_bytes", "critic_trainable", "init_cache", "load_hf", "save_hf",
           "sequence_logprobs", "split_critic_params", "token_logprobs"]
