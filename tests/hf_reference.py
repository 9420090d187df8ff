"""Tiny Hugging Face Qwen3.5-MoE reference models and checkpoint directories in every layout we must read."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from models.qwen35_moe.config import Qwen35MoeConfig


def hf_text_config(cfg: Qwen35MoeConfig):
    from transformers import Qwen3_5MoeTextConfig

    fields = {k: v for k, v in cfg.to_hf_text().items() if k not in ("architectures", "model_type")}
    return Qwen3_5MoeTextConfig(**fields)


def hf_model(cfg: Qwen35MoeConfig, seed: int = 0):
    """A random HF Qwen3_5MoeForCausalLM (fp32, eval) with non-trivial norm weights."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(hf_text_config(cfg)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # HF inits these to 0 / 1; perturb so a wrong norm shows
                param.add_(0.1 * torch.randn_like(param))
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def save_checkpoint(model, path: Path, *, experts: str, prefix: str, extra_towers: bool = False) -> Path:
    """Write `model` as transformers does (unfused or fused experts), then optionally re-key it to the released
    composite layout (`model.language_model.` + composite config.json) with vision/MTP tensors to be skipped."""
    model.save_pretrained(path, save_original_format=(experts == "unfused"))
    if prefix == "model.":
        return path
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    if extra_towers:
        renamed["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 2), np.float32)
        renamed["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    (path / "model.safetensors").unlink()
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    text["model_type"] = "qwen3_5_moe_text"
    text.pop("architectures", None)
    composite = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                 "text_config": text, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(composite))
    return path
